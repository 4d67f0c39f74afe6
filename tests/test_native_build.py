"""The native ops' build: ahead of time (`tf-pxg build-native`), logged at
WARNING with its duration, once across concurrent processes (fcntl lock),
into a cache directory of mode 0700 whose owner and mode are checked before
a library is loaded from it, with the compiler's warnings in the build log;
portable flags (an instruction-set level chosen from the CPU, never
`-march=native`, and the AVX512-FP16 guard); a failed build recorded so
that no process retries it, with one quiet WARNING line per process;
`--check` and `--force`.

The build compiles each source to an object file, up to one compiler per
CPU at once (a failing compile stops the others), then links them. A fake
compiler (a shell script writing the `-o` file) keeps most of these
fast; the FP16 checks compile one real kernel with `-fsyntax-only`, and
tests/test_native_noise.py builds the real library.
"""

import logging
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import time

import pytest

from tf_pxg import cli
from tf_pxg import native


def _compiler_script(tmp_path, name, sleep=0.0, warning=True,
                     fail_source=None, slow=0.0, barrier=0):
  """A fake compiler for the build's two kinds of command (other calls,
  e.g. flag probes, fail): `-c ... X.cc -o X.o` writes an object file (a
  line naming X.cc; with `warning`, compiling rows.cc prints a warning) and
  `-shared X.o ... -o LIB` checks that every object exists and writes "fake"
  to LIB. Each call sleeps `sleep` s. It records, in `tmp_path`:
  `compiles` (a line "SOURCE OBJECT MODE" per compile, MODE the object
  directory's), `links` (an "x" per
  link) and `concurrency` (how many compiles were running, itself included,
  as each started).

  `fail_source` (a file name): compiling it fails, with 200 lines of
  output, while the file `fail` in `tmp_path` exists; the other sources
  then take `slow` s more. `barrier`: each compile waits (up to 20 s) until
  that many compiles have started, and fails if they do not."""
  script = tmp_path / name
  running, started = tmp_path / "running", tmp_path / "started"
  running.mkdir(exist_ok=True)
  started.mkdir(exist_ok=True)
  script.write_text(
      "#!/bin/sh\n"
      'out=""; prev=""; src=""; mode=""\n'
      'for a in "$@"; do\n'
      '  [ "$prev" = "-o" ] && out="$a"\n'
      '  case "$a" in -c) mode=c;; -shared) mode=shared;; *.cc) src="$a";;\n'
      "  esac\n"
      '  prev="$a"\n'
      "done\n"
      '[ -n "$out" ] && [ -n "$mode" ] || exit 1\n'
      'if [ "$mode" = shared ]; then\n'
      '  for a in "$@"; do case "$a" in *.o) [ -e "$a" ] || {\n'
      '    echo "ld: error: $a: no such file" >&2; exit 1; };; esac; done\n'
      f'  echo x >> "{tmp_path / "links"}"\n'
      f"  sleep {sleep}\n"
      '  printf fake > "$out"\n'
      "  exit 0\n"
      "fi\n"
      f'echo "$(basename "$src") $out $(stat -c %a "$(dirname "$out")")" '
      f'>> "{tmp_path / "compiles"}"\n'
      f'touch "{running}/$$" "{started}/$$"\n'
      f'ls "{running}" | wc -l >> "{tmp_path / "concurrency"}"\n'
      f"if [ {barrier} -gt 0 ]; then\n"
      "  i=0\n"
      f'  while [ "$(ls "{started}" | wc -l)" -lt {barrier} ]; do\n'
      '    i=$((i+1)); [ $i -lt 400 ] || { rm -f "' + str(running) + '/$$";\n'
      '      echo "$src: error: the compiles did not run in parallel" >&2;\n'
      "      exit 1; }\n"
      "    sleep 0.05\n"
      "  done\n"
      "fi\n"
      f"sleep {sleep}\n"
      + (f'if [ "$(basename "$src")" = "{fail_source}" ] && '
         f'[ -e "{tmp_path / "fail"}" ]; then\n'
         '  i=0; while [ $i -lt 200 ]; do\n'
         f'    echo "In file included from x.h:$i: {_COMPILER_NOISE}" >&2\n'
         '    i=$((i+1)); done\n'
         f'  rm -f "{running}/$$"\n'
         "  exit 1\n"
         "fi\n"
         f'if [ -e "{tmp_path / "fail"}" ]; then\n'
         f'  sleep {slow} & echo $! > "{tmp_path}/sleeper.$$"; wait\n'
         "fi\n" if fail_source else "")
      + ('case "$src" in *rows.cc) '
         "echo \"rows.cc:1:1: warning: unused variable 'x'\" >&2;; esac\n"
         if warning else "") +
      'printf "object of %s\\n" "$src" > "$out"\n'
      f'rm -f "{running}/$$"\n')
  script.chmod(0o755)
  return str(script)


def _fake_compiler(tmp_path, sleep=0.0, warning=True):
  """A compiler that builds a library of "fake" (`_compiler_script`);
  returns it and the file with an "x" per build (link)."""
  return (_compiler_script(tmp_path, "fake-cxx", sleep, warning),
          tmp_path / "links")


# What a broken compiler prints: pages of it, none of which may reach stderr.
_COMPILER_NOISE = "PacketMathFP16.h:740:49: error: expected initializer"
# The source a `_failing_compiler` fails on: the first, so that every build
# attempt compiles it, whatever the number of parallel jobs.
_BROKEN = "conv_norms.cc"


def _failing_compiler(tmp_path, slow=0.0):
  """A compiler whose builds fail, compiling `_BROKEN` with pages of output,
  while the file `fail` beside it exists (the other sources then take
  `slow` s more); `_attempts` counts its build attempts."""
  cxx = _compiler_script(tmp_path, "failing-cxx", warning=False,
                         fail_source=_BROKEN, slow=slow)
  (tmp_path / "fail").write_text("")
  return cxx


def _attempts(tmp_path):
  """How many builds `_failing_compiler` saw: its compiles of `_BROKEN`."""
  return sum(source == _BROKEN for source, *_ in _compiles(tmp_path))


def _compiles(tmp_path):
  """The compiles `_compiler_script` recorded: [(source name, object,
  the object directory's mode)]."""
  compiles = tmp_path / "compiles"
  return [tuple(line.split()) for line in
          (compiles.read_text().splitlines() if compiles.exists() else [])]


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
  """A private $TMPDIR, so the fallback directory is the test's own."""
  tmp = tmp_path / "tmp"
  tmp.mkdir(mode=0o700)
  monkeypatch.setenv("TMPDIR", str(tmp))
  monkeypatch.setattr(native.tempfile, "tempdir", None)
  return tmp


def test_cache_directory_is_created_private(tmp_path, monkeypatch,
                                            tmpdir_env):
  del tmpdir_env
  cxx, _ = _fake_compiler(tmp_path)
  monkeypatch.setenv("CXX", cxx)
  cache = tmp_path / "home" / "cache" / "tf_pxg"
  path = pathlib.Path(native.build(cache_dir=cache))
  assert path.parent == cache
  assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
  assert os.stat(path).st_uid == os.geteuid()
  assert not os.stat(path).st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_first_use_warns_with_duration_and_compiler_warnings(
    tmp_path, monkeypatch, caplog, tmpdir_env):
  del tmpdir_env
  cxx, _ = _fake_compiler(tmp_path)
  monkeypatch.setenv("CXX", cxx)
  with caplog.at_level(logging.WARNING):
    path = pathlib.Path(native.build(cache_dir=tmp_path / "cache"))
  messages = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING]
  assert any("compiling the native ops" in m and "build-native" in m
             for m in messages), messages
  assert any(
      "compiled in" in m and " s (1 compiler warning(s), 1 in tf_pxg's"
      in m for m in messages
  ), messages
  assert "rows.cc:1:1: warning: unused variable 'x'" in caplog.text
  log = path.with_suffix(".log").read_text()
  assert "warning: unused variable 'x'" in log  # no -w: warnings kept
  assert "-w" not in log.split()
  assert "-w" not in native.compile_command("g++", path)
  assert "-w" not in native.object_command("g++", native.KERNELS / "rows.cc",
                                           path)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    native.build(cache_dir=tmp_path / "cache")  # cached: silent
  assert not caplog.records


@pytest.mark.parametrize("how", ["mode 0777", "mode 0775", "other owner"])
def test_unsafe_cache_directory_is_not_used(tmp_path, monkeypatch, how,
                                            tmpdir_env):
  cxx, count = _fake_compiler(tmp_path)
  monkeypatch.setenv("CXX", cxx)
  cache = tmp_path / "cache"
  cache.mkdir(mode=0o700)
  planted = pathlib.Path(native.build(cache_dir=cache))  # the name it uses
  if how == "other owner":
    if os.geteuid() != 0:
      pytest.skip("chown to another uid needs root")
    os.chown(cache, 12345, 12345)
    os.chown(planted, 12345, 12345)
    reason = "belongs to uid 12345"
  else:
    os.chmod(cache, 0o777 if how == "mode 0777" else 0o775)
    reason = "writable by group or others"
  with pytest.raises(OSError, match=reason):
    native.check_safe(cache)
  # The planted library is not returned: the build goes to the private
  # fallback under $TMPDIR instead.
  path = pathlib.Path(native.build(cache_dir=cache))
  assert path.parent == tmpdir_env / f"tf_pxg-{os.getuid()}"
  assert path.name == planted.name
  assert count.read_text().count("x") == 2
  # With the fallback unsafe too, nothing is loaded and the error says why.
  os.chmod(path.parent, 0o777)
  with pytest.raises(OSError, match=r"no usable cache directory.*" + reason):
    native.build(cache_dir=cache)


def test_unsafe_library_file_is_not_loaded(tmp_path, monkeypatch, tmpdir_env):
  del tmpdir_env
  cxx, _ = _fake_compiler(tmp_path)
  monkeypatch.setenv("CXX", cxx)
  path = pathlib.Path(native.build(cache_dir=tmp_path / "cache"))
  os.chmod(path, 0o666)
  with pytest.raises(OSError, match="writable by group or others"):
    native.build(cache_dir=tmp_path / "cache")


_WORKER = """
import os, sys, time, pathlib
from tf_pxg import native
ready, go, cache = sys.argv[1:4]
pathlib.Path(ready).write_text("")
while not os.path.exists(go):
  time.sleep(0.01)
print(native.build(cache_dir=cache))
"""


def test_concurrent_processes_build_once(tmp_path):
  cxx, count = _fake_compiler(tmp_path, sleep=2)
  env = dict(os.environ, CXX=cxx, TMPDIR=str(tmp_path))
  go = tmp_path / "go"
  procs = [subprocess.Popen(
      [sys.executable, "-c", _WORKER, str(tmp_path / f"ready{i}"), str(go),
       str(tmp_path / "cache")], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(3)]
  deadline = time.monotonic() + 300
  while not all((tmp_path / f"ready{i}").exists() for i in range(3)):
    assert time.monotonic() < deadline
    assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
    time.sleep(0.05)
  go.write_text("")
  outs = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  paths = {out.strip() for out, _ in outs}
  assert len(paths) == 1
  assert count.read_text().count("x") == 1  # built once, the others waited


def test_sources_compile_in_parallel_then_link(tmp_path, monkeypatch,
                                               tmpdir_env):
  """With CPUs enough, every source compiles at once (each compile of the
  fake waits until all have started), each to an object file in a private
  directory beside the library, then one link; the directory is removed
  and the log holds every command with its exit status."""
  del tmpdir_env
  sources = native.sources()
  monkeypatch.setattr(native.os, "cpu_count", lambda: len(sources) + 3)
  cxx = _compiler_script(tmp_path, "parallel-cxx", barrier=len(sources))
  monkeypatch.setenv("CXX", cxx)
  cache = tmp_path / "cache"
  path = pathlib.Path(native.build(cache_dir=cache))
  assert path.read_text() == "fake"
  compiles = _compiles(tmp_path)
  assert sorted(source for source, _, _ in compiles) == [
      f.name for f in sources]
  (objects,) = {pathlib.Path(obj).parent for _, obj, _ in compiles}
  assert {mode for _, _, mode in compiles} == {"700"}
  assert objects.parent == cache and objects.name.startswith(path.stem)
  assert not objects.exists()
  assert sorted(f.name for f in cache.iterdir()) == sorted(
      [path.name, path.stem + ".lock", path.stem + ".log"])
  assert (tmp_path / "links").read_text() == "x\n"
  log = path.with_suffix(".log").read_text().splitlines()
  commands = [line for line in log if line.startswith("$ ")]
  assert len(commands) == len(sources) + 1
  assert all(" -c -fPIC " in c for c in commands[:-1])
  assert " -shared " in commands[-1]
  assert sum(line.startswith("exit 0 after ") and line.endswith(" s")
             for line in log) == len(sources) + 1


@pytest.mark.parametrize("cpus", [2, 1, None])
def test_at_most_one_compiler_per_cpu(tmp_path, monkeypatch, tmpdir_env,
                                      cpus):
  del tmpdir_env
  monkeypatch.setattr(native.os, "cpu_count", lambda: cpus)
  monkeypatch.setenv("CXX", _compiler_script(tmp_path, "cxx", sleep=0.3))
  native.build(cache_dir=tmp_path / "cache")
  running = [int(n) for n in
             (tmp_path / "concurrency").read_text().split()]
  assert len(running) == len(native.sources())
  assert max(running) <= (cpus or 1), running


def _alive(pid):
  """Whether process `pid` runs (exists and is no zombie)."""
  try:
    stat_line = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return False
  return stat_line.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_failing_compile_stops_the_others(tmp_path, monkeypatch,
                                            tmpdir_env):
  """One source fails at once while the others would take two minutes:
  the build fails at once, the running compiles (and their children) are
  killed, and the failure is recorded once, with the failing compile's
  first error; nothing is linked and no object or partial file is left."""
  del tmpdir_env
  sources = native.sources()
  monkeypatch.setattr(native.os, "cpu_count", lambda: len(sources))
  cxx = _failing_compiler(tmp_path, slow=120)
  monkeypatch.setenv("CXX", cxx)
  cache = tmp_path / "cache"
  start = time.monotonic()
  with pytest.raises(native.BuildFailed,
                     match="failing-cxx exited with status 1: In file "
                     "included from x.h:0: PacketMathFP16"):
    native.build(cache_dir=cache)
  assert time.monotonic() - start < 60
  deadline = time.monotonic() + 10
  sleepers = [int(f.read_text()) for f in tmp_path.glob("sleeper.*")]
  while any(map(_alive, sleepers)) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(map(_alive, sleepers))
  assert not (tmp_path / "links").exists()
  log = next(cache.glob("*.log")).read_text()
  assert log.count(_COMPILER_NOISE) == 200
  assert sum(line.startswith("exit 1 after ") for line in
             log.splitlines()) == 1
  assert log.count("stopped (exit -9): another step failed\n") == len(
      sources) - 1
  assert sorted(f.suffix for f in cache.iterdir()) == [
      ".failed", ".lock", ".log"]


def test_a_build_that_takes_too_long_is_stopped(tmp_path, monkeypatch,
                                                tmpdir_env):
  del tmpdir_env
  monkeypatch.setattr(native, "_TIMEOUT", 1)
  monkeypatch.setenv("CXX", _compiler_script(tmp_path, "slow-cxx",
                                             sleep=60))
  cache = tmp_path / "cache"
  start = time.monotonic()
  with pytest.raises(native.BuildFailed, match="longer than 1 s"):
    native.build(cache_dir=cache)
  assert time.monotonic() - start < 30
  log = next(cache.glob("*.log")).read_text()
  assert log.count("stopped (exit -9): the build took too long\n") == min(
      os.cpu_count() or 1, len(native.sources()))
  assert sorted(f.suffix for f in cache.iterdir()) == [
      ".failed", ".lock", ".log"]


def test_cli_build_native(tmp_path, monkeypatch, capsys, tmpdir_env):
  del tmpdir_env
  cxx, _ = _fake_compiler(tmp_path, warning=False)
  monkeypatch.setenv("CXX", cxx)
  assert cli.main(["tf-pxg", "build-native",
                   f"--cache_dir={tmp_path / 'image-cache'}"]) == 0
  out = capsys.readouterr().out.strip()
  assert out.startswith(str(tmp_path / "image-cache"))
  assert pathlib.Path(out).read_text() == "fake"
  assert cli.main(["tf-pxg", "build-native", "--help"]) == 0
  assert "ahead of time" in capsys.readouterr().out
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  assert cli.main(["tf-pxg", "build-native",
                   f"--cache_dir={tmp_path / 'other'}"]) == 1
  assert "build-native: error" in capsys.readouterr().err


# Portable flags --------------------------------------------------------------

_V3 = ("abm avx avx2 bmi1 bmi2 cx16 f16c fma lahf_lm movbe popcnt sse4_1 "
       "sse4_2 ssse3 xsave")
_V4 = _V3 + " avx512bw avx512cd avx512dq avx512f avx512vl"


@pytest.mark.parametrize("machine,flags,level", [
    ("x86_64", _V4 + " avx512fp16 amx_tile", "x86-64-v4"),
    ("x86_64", _V4, "x86-64-v4"),
    ("x86_64", _V3 + " avx512f", "x86-64-v3"),  # AVX-512F alone is not v4
    ("x86_64", _V3, "x86-64-v3"),
    ("x86_64", "cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3", "x86-64-v2"),
    ("x86_64", "", "baseline"),
    ("aarch64", "fp asimd sve", "baseline"),
])
def test_isa_level_follows_the_cpu(monkeypatch, machine, flags, level):
  monkeypatch.delenv("TF_PXG_NATIVE_ISA", raising=False)
  monkeypatch.delenv("TF_PXG_NATIVE_FLAGS", raising=False)
  monkeypatch.setattr(native.platform, "machine", lambda: machine)
  monkeypatch.setattr(native, "_cpu_info",
                      lambda: ("a CPU", frozenset(flags.split())))
  assert native.isa() == level
  expected = [] if level == "baseline" else [f"-march={level}"]
  for command in (native.compile_command("g++", pathlib.Path("lib.so")),
                  native.object_command("g++", native.KERNELS / "rows.cc",
                                        pathlib.Path("rows.o"))):
    assert "-march=native" not in command
    assert [f for f in command if f.startswith("-march")] == expected
    if machine != "x86_64":
      assert "-mno-avx512fp16" not in command


def test_isa_level_from_the_environment(monkeypatch):
  monkeypatch.setenv("TF_PXG_NATIVE_ISA", "x86-64-v3")
  assert native.isa() == "x86-64-v3"
  monkeypatch.setenv("TF_PXG_NATIVE_ISA", "avx9000")
  with pytest.raises(ValueError, match="TF_PXG_NATIVE_ISA=avx9000 is not "
                     "one of baseline, x86-64-v2"):
    native.isa()


def test_the_library_name_keys_level_flags_compiler_and_cpu(
    tmp_path, monkeypatch):
  cxx, _ = _fake_compiler(tmp_path)
  monkeypatch.delenv("TF_PXG_NATIVE_FLAGS", raising=False)
  monkeypatch.setattr(native, "_cpu_info", lambda: ("cpu A", frozenset()))
  v3 = native.library_name(cxx, "x86-64-v3")
  assert v3.startswith("tf_pxg_ops-x86-64-v3-")
  assert v3 == native.library_name(cxx, "x86-64-v3")
  assert native.library_name(cxx, "x86-64-v4") != v3
  # The CPU's model enters only where the code depends on it.
  native_a = native.library_name(cxx, "native")
  monkeypatch.setattr(native, "_cpu_info", lambda: ("cpu B", frozenset()))
  assert native.library_name(cxx, "x86-64-v3") == v3
  assert native.library_name(cxx, "native") != native_a
  monkeypatch.setenv("TF_PXG_NATIVE_FLAGS", "-mtune=native")
  tuned = native.library_name(cxx, "x86-64-v3")
  assert tuned != v3
  monkeypatch.setattr(native, "_cpu_info", lambda: ("cpu C", frozenset()))
  assert native.library_name(cxx, "x86-64-v3") != tuned  # extra flags: CPU
  monkeypatch.delenv("TF_PXG_NATIVE_FLAGS")
  # Another build command (e.g. an added link flag).
  link = native.link_command
  monkeypatch.setattr(native, "link_command",
                      lambda *args: link(*args) + ["-Wl,-z,now"])
  assert native.library_name(cxx, "x86-64-v3") != v3
  monkeypatch.setattr(native, "link_command", link)
  assert native.library_name(cxx, "x86-64-v3") == v3
  pathlib.Path(cxx).write_text(pathlib.Path(cxx).read_text() + "\n# new\n")
  assert native.library_name(cxx, "x86-64-v3") != v3  # an upgraded compiler


def _syntax_check(cxx, level):
  """`-fsyntax-only` of rows.cc (the smallest kernel, with TF's and Eigen's
  headers) with the build's flags: (exit status, output)."""
  command = native.compile_command(cxx, None, level,
                                   files=[native.KERNELS / "rows.cc"])
  assert command.index("-mavx512fp16") < command.index("-mno-avx512fp16")
  done = subprocess.run(command, capture_output=True, text=True, timeout=600)
  return done.returncode, done.stdout + done.stderr


def _knows_avx512fp16(cxx) -> bool:
  return subprocess.run([cxx, "-mavx512fp16", "-x", "c++", "-fsyntax-only",
                         "-"], input="", capture_output=True,
                        timeout=60).returncode == 0


def _compilers():
  return [c for c in ("g++", "clang++") if shutil.which(c)]


@pytest.mark.skipif(native.platform.machine() != "x86_64", reason="x86 only")
@pytest.mark.parametrize("cxx", _compilers())
def test_avx512fp16_is_neutralised(cxx, monkeypatch):
  """Issue 30: with `__AVX512FP16__` defined (`-march=native` on an Intel
  CPU with AVX512-FP16), TF's bundled Eigen does not compile with gcc 12.
  Compile-only (the library would not run on a CPU without it): the old
  flags plus `-mavx512fp16` reproduce the error where the compiler has it;
  the build's flags compile with `-mavx512fp16` added (at this CPU's
  level; `native` differs only in `-march`), since the guard comes last."""
  if not _knows_avx512fp16(cxx):
    pytest.skip(f"{cxx} does not know -mavx512fp16 (so cannot define "
                "__AVX512FP16__)")
  monkeypatch.setattr(native, "_probed", {})
  monkeypatch.setenv("TF_PXG_NATIVE_FLAGS", "-mavx512fp16")
  old = [cxx, str(native.KERNELS / "rows.cc"), "-fsyntax-only", "-O3",
         "-march=native", "-fno-math-errno", "-mavx512fp16",
         *native.tf.sysconfig.get_compile_flags()]
  done = subprocess.run(old, capture_output=True, text=True, timeout=600)
  if done.returncode != 0:  # gcc 12; newer compilers may parse it
    # Eigen's FP16 packet math (a CPU with AVX512-VL), or, where
    # `-march=native` lacks AVX512-VL (seen on an AMD EPYC VM), Eigen's
    # own refusal of `-mavx512fp16` without `-mavx512vl`.
    assert ("PacketMathFP16.h" in done.stderr or
            "without AVX512-VL" in done.stderr), done.stderr[-2000:]
  status, output = _syntax_check(cxx, native.isa())
  assert status == 0, output[-3000:]
  assert "PacketMathFP16" not in output


@pytest.mark.skipif(not shutil.which("g++"), reason="needs g++")
@pytest.mark.parametrize("flags", [
    "-fsanitize=signed-integer-overflow -fno-sanitize-recover=all"])
def test_extra_flags_reach_the_link(tmp_path, monkeypatch, flags):
  """Stop 56's CI: with `$TF_PXG_NATIVE_FLAGS` holding sanitizer flags,
  the objects called the sanitizer's runtime but the link did not name it,
  so the library failed to load ("undefined symbol:
  __ubsan_handle_add_overflow_abort"). The build's own object and link
  commands, with real g++, on a source whose signed addition the flag
  instruments: the library loads (ctypes binds every symbol at load,
  RTLD_NOW) and its function runs."""
  import ctypes
  monkeypatch.setenv("TF_PXG_NATIVE_FLAGS", flags)
  monkeypatch.setattr(native, "_probed", {})
  source = tmp_path / "add.cc"
  source.write_text('extern "C" int tf_pxg_add(int a, int b) '
                    "{ return a + b; }\n")
  obj, lib = tmp_path / "add.o", tmp_path / "libadd.so"
  for command in (native.object_command("g++", source, obj),
                  native.link_command("g++", [obj], lib)):
    done = subprocess.run(command, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
  assert "__ubsan_handle_add_overflow" in subprocess.run(
      ["nm", "-u", str(lib)], capture_output=True, text=True).stdout
  assert ctypes.CDLL(str(lib)).tf_pxg_add(40, 2) == 42


# A failed build: recorded, one attempt, quiet -------------------------------

_LOADER = """
import os, sys, time, pathlib
from tf_pxg import native
ready, go = sys.argv[1:3]
pathlib.Path(ready).write_text("")
while not os.path.exists(go):
  time.sleep(0.01)
print("loaded" if native.library() is not None else "fallback")
"""


def _run_loaders(tmp_path, env, n, tag):
  """Starts `n` processes together, each asking for `native.library()`;
  returns their (stdout, stderr)."""
  go = tmp_path / f"go-{tag}"
  ready = [tmp_path / f"ready-{tag}{i}" for i in range(n)]
  procs = [subprocess.Popen([sys.executable, "-c", _LOADER, str(r), str(go)],
                            env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
           for r in ready]
  deadline = time.monotonic() + 300
  while not all(r.exists() for r in ready):
    assert time.monotonic() < deadline
    assert all(p.poll() is None for p in procs), [p.communicate()
                                                  for p in procs]
    time.sleep(0.05)
  go.write_text("")
  outs = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  return outs


def _tf_pxg_lines(stderr):
  return [l for l in stderr.splitlines() if "tf_pxg:" in l]


def test_a_failing_compiler_is_tried_once_across_processes(tmp_path):
  cxx = _failing_compiler(tmp_path)
  env = dict(os.environ, CXX=cxx, TMPDIR=str(tmp_path),
             TF_PXG_CACHE_DIR=str(tmp_path / "cache"))
  env.pop("TF_PXG_NATIVE", None)
  outs = _run_loaders(tmp_path, env, 3, "a") + _run_loaders(
      tmp_path, env, 1, "b")  # three together, one later
  assert _attempts(tmp_path) == 1  # one attempt in total
  assert not (tmp_path / "links").exists()
  for out, err in outs:
    assert out.strip() == "fallback"
    # The compiler's output goes to the log; the warning quotes its first
    # error line, and nothing else of it reaches stderr.
    (warning,) = [l for l in _tf_pxg_lines(err) if "unavailable" in l]
    assert "x.h:0: " + _COMPILER_NOISE in warning
    assert "x.h:1:" not in err and err.count(_COMPILER_NOISE) == 1
    assert "tf-pxg build-native --force" in warning
    assert "failing-cxx exited with status 1" in warning
    assert "is recorded" in warning
    # One line besides, in the one process that compiled.
    assert len(_tf_pxg_lines(err)) <= 2, err
  assert sum(len(_tf_pxg_lines(err)) == 2 for _, err in outs) == 1
  (log,) = (tmp_path / "cache").glob("*.log")
  assert log.read_text().count(_COMPILER_NOISE) == 200
  (record,) = (tmp_path / "cache").glob("*.failed")
  assert record.stem == log.stem
  assert not list((tmp_path / "cache").glob("*.objects"))


def test_force_retries_a_recorded_failure(tmp_path, monkeypatch, capsys,
                                          tmpdir_env):
  del tmpdir_env
  cxx = _failing_compiler(tmp_path)
  monkeypatch.setenv("CXX", cxx)
  cache = tmp_path / "cache"
  with pytest.raises(native.BuildFailed, match="exited with status 1"):
    native.build(cache_dir=cache)
  (tmp_path / "fail").unlink()  # the compiler is fixed, its name unchanged
  with pytest.raises(native.BuildFailed, match="is recorded"):
    native.build(cache_dir=cache)  # not retried
  assert cli.main(["tf-pxg", "build-native", f"--cache_dir={cache}"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--force" in err
  assert _attempts(tmp_path) == 1
  assert cli.main(["tf-pxg", "build-native", f"--cache_dir={cache}",
                   "--force"]) == 0
  path = pathlib.Path(capsys.readouterr().out.strip())
  assert path.read_text() == "fake" and _attempts(tmp_path) == 2
  assert not list(cache.glob("*.failed"))
  assert native.build(cache_dir=cache) == str(path)  # cached
  assert native.build(cache_dir=cache, force=True) == str(path)  # rebuilt
  assert _attempts(tmp_path) == 3


def test_check_names_each_op_and_why(tmp_path, monkeypatch, capsys,
                                     tmpdir_env):
  del tmpdir_env
  monkeypatch.delenv("TF_PXG_NATIVE", raising=False)  # also under =0
  ops = native.ops()
  assert set(ops) == set(native.FALLBACKS)
  assert "TfPxgConv2DFilterWeightedSum" in ops and len(ops) == 8
  cxx = _failing_compiler(tmp_path)
  monkeypatch.setenv("CXX", cxx)
  cache = tmp_path / "cache"

  def check():
    status = cli.main(["tf-pxg", "build-native", "--check",
                       f"--cache_dir={cache}"])
    return status, capsys.readouterr().out

  status, out = check()
  assert status == 1
  assert "why: not built yet" in out
  assert all(f"{op}" in out for op in ops)
  assert out.count("fallback: ") == len(ops)
  with pytest.raises(native.BuildFailed):
    native.build(cache_dir=cache)
  status, out = check()
  assert status == 1 and "why: building tf_pxg_ops-" in out
  assert "--force" in out
  monkeypatch.setenv("TF_PXG_NATIVE", "0")
  status, out = check()
  assert status == 1 and "why: TF_PXG_NATIVE=0" in out
  assert cli.main(["tf-pxg", "build-native", "--check", "--force"]) == 2


def test_check_of_the_built_library(native_ops, capsys):
  """On this machine (the `native_ops` fixture built the library) every op
  is native."""
  del native_ops
  assert cli.main(["tf-pxg", "build-native", "--check"]) == 0
  out = capsys.readouterr().out
  assert out.count(" native\n") == len(native.ops()), out
  assert "fallback:" not in out and "why:" not in out
