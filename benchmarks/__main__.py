"""`python -m benchmarks`: the benchmark suite (see benchmarks/suite.py)."""

from absl import app

from benchmarks import suite

if __name__ == "__main__":
  app.run(suite.main)
