"""examples/dp_probabilistic_regression.py runs and prints what it promises."""

import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow_probability")
pytest.importorskip("sklearn")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLE = os.path.join(_ROOT, "examples", "dp_probabilistic_regression.py")


def _final(*flags):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env["PYTHONPATH"] = os.pathsep.join([_ROOT, env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, _EXAMPLE, "--epochs=3",
                         "--samples=200", *flags], capture_output=True,
                        text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("final:")][-1]
  return dict(re.findall(r"(\w+)=([^\s]+)", line))


@pytest.mark.parametrize("head", ["StudentT", "CensoredWeibull"])
def test_example_prints_epsilon_loglik_and_coverage(head):
  out = _final(f"--head={head}", "--target_epsilon=1")
  assert out["head"] == head
  assert 0 < float(out["epsilon"]) <= 1.0 + 1e-6
  assert math.isfinite(float(out["test_loglik"]))
  assert 0.0 <= float(out["coverage90"]) <= 1.0
  nodp = _final(f"--head={head}", "--nodp")
  assert nodp["epsilon"] == "inf"
