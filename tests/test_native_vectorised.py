"""The native noise op's sampling loops are vectorised at every x86-64
level the library is built for, with g++ and with clang++.

`tf_pxg/kernels/threefry_normal.h` is written for the compiler's
auto-vectoriser (tf_pxg/native.py builds it with `-O3` at the CPU's psABI
level). A loop that stays scalar still computes the same numbers, so no
numerical test sees it; it shows only as time. GCC 12 left the
Box-Muller loop scalar at x86-64-v2 and v3 (AVX2 machines: 11 ns per
Gaussian instead of 2) because one select in `Log` needed AVX-512's mask
registers, and a BERT-base DP step spent 9 % of its time drawing noise.

Each case compiles the header alone (no TensorFlow headers, no
instruction of the level is executed, so every level is checked on any
x86-64 machine) with the compiler's vectoriser report, and requires both
of the header's `for (int j = 0; j < kPairs; ++j)` loops (the Threefry
rounds and the Box-Muller transform) to be reported vectorised.
"""

import platform
import re
import shutil
import subprocess

import pytest

from tf_pxg import native

HEADER = native.KERNELS / "threefry_normal.h"
LEVELS = ("x86-64-v2", "x86-64-v3", "x86-64-v4")
# (compiler, the flag that reports vectorised loops, the report's pattern
# with the file name and line of a vectorised loop).
COMPILERS = {
    "g++": ("-fopt-info-vec-optimized",
            r"threefry_normal\.h:(\d+):\d+: optimized: loop vectorized"),
    "clang++": ("-Rpass=loop-vectorize",
                r"threefry_normal\.h:(\d+):\d+: remark: vectorized loop"),
}

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"),
    reason="the psABI levels are x86-64's")


def _sampling_loops():
  """Line numbers of the header's loops over a block's pairs."""
  lines = HEADER.read_text().splitlines()
  found = [i + 1 for i, line in enumerate(lines)
           if "for (int j = 0; j < kPairs; ++j)" in line]
  assert len(found) == 2, "expected the Threefry and Box-Muller loops"
  return found


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("cxx", sorted(COMPILERS))
def test_the_sampling_loops_are_vectorised(cxx, level, tmp_path):
  if shutil.which(cxx) is None:
    pytest.skip(f"{cxx} is not installed")
  report_flag, pattern = COMPILERS[cxx]
  source = tmp_path / "draw.cc"
  source.write_text(
      f'#include "{HEADER}"\n'
      "void Draw(unsigned k, unsigned c, float* z) {\n"
      "  tf_pxg::threefry_normal::NormalPairs(k, 1u, 2u, c, 1.5f, z);\n"
      "}\n")
  result = subprocess.run(
      [cxx, *native.optimization_flags(level), report_flag, "-c",
       str(source), "-o", str(tmp_path / "draw.o")],
      capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr
  vectorised = {int(m) for m in re.findall(pattern, result.stderr)}
  loops = _sampling_loops()
  missing = [n for n in loops if n not in vectorised]
  assert not missing, (
      f"{cxx} at {level} left the loop(s) at line(s) {missing} of "
      f"{HEADER.name} scalar (vectorised: {sorted(vectorised)}):\n"
      + result.stderr[-3000:])
