// prescope: command line entry point (subcommands added per feature).
int main() { return 0; }
