#include "format/gguf.h"
#include <gtest/gtest.h>
TEST(Gguf, Placeholder) { SUCCEED(); }
