"""Tests for the tf-pxg command line."""

import os
import subprocess
import sys

import dp_accounting
import pytest

from tf_pxg import accounting
from tf_pxg import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--num_examples=60000", "--batch_size=256", "--epochs=60"]


def _main(capsys, *args):
  code = cli.main(["tf-pxg", *args])
  out, err = capsys.readouterr()
  return code, out, err


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_epsilon_prints_compute_epsilon(capsys, acc):
  code, out, err = _main(capsys, "epsilon", *RUN, "--noise_multiplier=1.1",
                         f"--accountant={acc}")
  assert (code, err) == (0, "")
  expected = accounting.compute_epsilon(
      60000, 256, 1.1, epochs=60, accountant=acc)
  assert float(out) == expected


def test_epsilon_with_steps_and_delta(capsys):
  code, out, _ = _main(capsys, "epsilon", "--num_examples", "50000",
                       "--batch_size", "500", "--noise_multiplier", "0.9",
                       "--steps", "3000", "--delta", "1e-6")
  assert code == 0
  assert float(out) == accounting.compute_epsilon(
      50000, 500, 0.9, steps=3000, delta=1e-6)


def test_noise_prints_noise_multiplier(capsys):
  code, out, err = _main(capsys, "noise", "--target_epsilon=3", *RUN,
                         "--tolerance=1e-3")
  assert (code, err) == (0, "")
  assert float(out) == accounting.noise_multiplier_for_epsilon(
      3.0, 60000, 256, epochs=60, tolerance=1e-3)


@pytest.mark.parametrize("bands", [1, 4, 16])
def test_epsilon_num_bands_passed_through(capsys, bands):
  code, out, err = _main(capsys, "epsilon", *RUN, "--noise_multiplier=1.1",
                         f"--num_bands={bands}")
  assert (code, err) == (0, "")
  assert float(out) == accounting.compute_epsilon(
      60000, 256, 1.1, epochs=60, num_bands=bands)
  # Independently: ceil(T / b) rounds at q = B b / N.
  rounds = -(-14063 // bands)
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          256 * bands / 60000, dp_accounting.GaussianDpEvent(1.1)), rounds)
  assert float(out) == pytest.approx(
      dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS)).compose(
          event).get_epsilon(1e-5), rel=1e-12)


def test_epsilon_default_is_one_band(capsys):
  _, default, _ = _main(capsys, "epsilon", *RUN, "--noise_multiplier=1.1")
  _, one, _ = _main(capsys, "epsilon", *RUN, "--noise_multiplier=1.1",
                    "--num_bands=1")
  assert default == one


def test_noise_num_bands_passed_through(capsys):
  code, out, err = _main(capsys, "noise", "--target_epsilon=3", *RUN,
                         "--tolerance=1e-3", "--num_bands", "8")
  assert (code, err) == (0, "")
  assert float(out) == accounting.noise_multiplier_for_epsilon(
      3.0, 60000, 256, epochs=60, tolerance=1e-3, num_bands=8)
  assert float(out) != accounting.noise_multiplier_for_epsilon(
      3.0, 60000, 256, epochs=60, tolerance=1e-3)


@pytest.mark.parametrize("args", [["--help"], ["epsilon", "--help"],
                                  ["noise", "-h"]])
def test_help(capsys, args):
  code, out, err = _main(capsys, *args)
  assert (code, err) == (0, "")
  assert out.startswith("usage: tf-pxg")
  if args[0] == "noise":
    assert "--target_epsilon" in out and "--noise_multiplier" not in out
  if args[0] in ("epsilon", "noise"):
    assert "--num_bands" in out and "default 1" in out


BAD = [
    # args, text the one-line error must contain
    (["epsilon", *RUN, "--noise_multiplier=1.1", "--batch_size=0"],
     "batch_size"),
    (["epsilon", *RUN, "--noise_multiplier=1.1", "--batch_size=70000"],
     "batch_size"),
    (["epsilon", *RUN, "--noise_multiplier=-1"], "noise_multiplier"),
    (["epsilon", *RUN, "--noise_multiplier=abc"], "--noise_multiplier=abc"),
    (["epsilon", *RUN], "--noise_multiplier"),
    (["epsilon", "--batch_size=256", "--epochs=1", "--noise_multiplier=1"],
     "--num_examples"),
    (["epsilon", *RUN, "--noise_multiplier=1", "--steps=10"],
     "exactly one of --epochs and --steps"),
    (["epsilon", "--num_examples=100", "--batch_size=10",
      "--noise_multiplier=1"], "exactly one of --epochs and --steps"),
    (["epsilon", *RUN, "--noise_multiplier=1", "--delta=1"], "delta"),
    (["epsilon", *RUN, "--noise_multiplier=1", "--accountant=moments"],
     "--accountant=moments"),
    (["epsilon", *RUN, "--noise_multiplier=1", "--target_epsilon=3"],
     "target_epsilon"),
    (["epsilon", *RUN, "--noise_multiplier=1", "stray"], "'stray'"),
    (["noise", *RUN], "--target_epsilon"),
    (["noise", *RUN, "--target_epsilon=0"], "target_epsilon"),
    (["noise", *RUN, "--target_epsilon=1", "--tolerance=-1"], "tolerance"),
    (["noise", *RUN, "--target_epsilon=3", "--noise_multiplier=1"],
     "noise_multiplier"),
    (["epsilon", *RUN, "--noise_multiplier=1", "--num_bands=0"],
     "num_bands must be a positive integer"),
    (["epsilon", *RUN, "--noise_multiplier=1", "--num_bands=235"],
     "num_bands=235 is too large"),
    (["noise", *RUN, "--target_epsilon=1", "--num_bands=235"],
     "Use num_bands <= 234"),
    (["epsilon", *RUN, "--noise_multiplier=1", "--num_bands=2.5"],
     "--num_bands=2.5"),
    (["privacy", *RUN], "'privacy'"),
    ([], "no command"),
]


@pytest.mark.parametrize("args,names", BAD)
def test_bad_input_one_line_exit_2(capsys, args, names):
  code, out, err = _main(capsys, *args)
  assert code == 2
  assert out == ""
  assert err.count("\n") == 1 and err.endswith("\n")
  assert err.startswith("tf-pxg")
  assert ": error: " in err
  assert names in err


def test_importing_cli_defines_no_global_flags():
  """In a fresh interpreter: other test modules may define absl flags."""
  names = ("num_examples", "batch_size", "noise_multiplier", "target_epsilon",
           "epochs", "steps", "accountant", "num_bands")
  code = ("import tf_pxg.cli; from absl import flags; "
          f"print([n for n in {names!r} if n in flags.FLAGS])")
  env = dict(os.environ, PYTHONPATH=REPO)
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout
  assert out.strip() == "[]"


def test_python_dash_m_subprocess():
  """The real entry point: `python -m tf_pxg.cli` through absl's app.run."""
  env = dict(os.environ, PYTHONPATH=REPO)
  good = ["epsilon", *RUN, "--noise_multiplier=1.1"]
  bad = ["epsilon", *RUN, "--noise_multiplier=1.1", "--batch_size=70000"]
  # Start both at once: each pays the TensorFlow import.
  procs = [
      subprocess.Popen([sys.executable, "-m", "tf_pxg.cli", *args], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, cwd=REPO) for args in (good, bad)
  ]
  (good_out, good_err), (bad_out, bad_err) = [p.communicate(timeout=120)
                                              for p in procs]
  assert procs[0].returncode == 0, good_err
  assert float(good_out) == accounting.compute_epsilon(
      60000, 256, 1.1, epochs=60)
  assert procs[1].returncode == 2
  assert bad_out == ""
  assert "Traceback" not in bad_err
  # stderr may start with TensorFlow's import-time log lines; ours is last.
  last = bad_err.strip().splitlines()[-1]
  assert last.startswith("tf-pxg epsilon: error: batch_size")
  assert "70000" in last
