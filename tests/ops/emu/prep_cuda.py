"""Rewrites a CUDA source for the CPU emulation (tests/ops/emu): kernel launches become emu_launch calls
and dynamic shared memory a pointer into the emulated block. Usage: prep_cuda.py IN.cu OUT.cpp"""
import pathlib
import re
import sys


def main() -> None:
    src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    text = src.read_text()
    # name<<<grid, block, smem, stream>>>(args)  ->  emu_launch(name, grid, block, smem, stream, args)
    text = re.sub(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\(", r"emu_launch(\1, \2, ", text, flags=re.S)
    text = re.sub(r"extern __shared__ __align__\(16\) (\w+) (\w+)\[\];", r"\1 *\2 = emu_dyn_smem<\1>();", text)
    if "<<<" in text or "extern __shared__" in text:
        sys.exit(f"{src}: a launch or shared declaration the emulation cannot rewrite")
    text = f"// Generated from {src} by prep_cuda.py for the CPU emulation.\n" + text
    if not out.exists() or out.read_text() != text:  # keep the timestamp when nothing changed
        out.write_text(text)


if __name__ == "__main__":
    main()
