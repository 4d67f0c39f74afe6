"""The native ops' build: ahead of time (`tf-pxg build-native`), logged at
WARNING with its duration, once across concurrent processes (fcntl lock),
into a cache directory of mode 0700 whose owner and mode are checked before
a library is loaded from it, with the compiler's warnings in the build log.

A fake compiler (a shell script writing the `-o` file) keeps these fast;
tests/test_native_noise.py builds the real library.
"""

import logging
import os
import pathlib
import stat
import subprocess
import sys
import time

import pytest

from tf_pxg import cli
from tf_pxg import native


def _fake_compiler(tmp_path, sleep=0.0, warning=True):
  script = tmp_path / "fake-cxx"
  count = tmp_path / "compilations"
  script.write_text(
      "#!/bin/sh\n"
      'out=""; prev=""\n'
      'for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
      f'echo x >> "{count}"\n'
      f"sleep {sleep}\n"
      + ("echo \"rows.cc:1:1: warning: unused variable 'x'\" >&2\n"
         if warning else "") +
      'printf fake > "$out"\n')
  script.chmod(0o755)
  return str(script), count


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
  assert "-w" not in native._FLAGS  # pylint: disable=protected-access
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
