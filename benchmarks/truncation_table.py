"""ε of truncated Poisson batches against padded/carried Poisson batches.

    python -m benchmarks.truncation_table [--num_examples=60000]
        [--batch_sizes=256,1024,4096] [--target_epsilon=8] [--delta=1e-5]
        [--epochs=10] [--interval=1e-3]

For each expected batch size B: σ is calibrated so that untruncated
Poisson DP-SGD (`tf_pxg.data.PoissonSampler`: padded to P = ceil(B +
4 sqrt(B)) rows, overflow carried into extra physical batches; exact) is
(target ε, δ)-DP after `epochs` epochs by PLD; then, at the same σ and
steps, truncated Poisson sampling (`tf_pxg.data.truncated_poisson`: one
batch of B_max rows per step) at B_max = B, B + 2 sqrt(B), B + 4 sqrt(B)
(rounded up) is accounted with dp-accounting's
`TruncatedSubsampledGaussianDpEvent`. Both ε use one PLD discretisation
interval (`--interval`), so they compare like for like.

Columns: ε; the per-step probability that the draw exceeds the batch
(a carried batch for padded Poisson, a truncation otherwise: P(n > rows),
n ~ Binomial(N, q)); and the padding, the expected fraction of the
step's rows that are masked ((rows - E[min(n, rows)]) / rows, plus for
padded Poisson the carried batch's rows). Prints a markdown table.
"""

import math

from absl import app
from absl import flags
import dp_accounting
import numpy as np
from scipy import stats

from tf_pxg import accounting
from tf_pxg.data import poisson

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_examples", 60000, "N.")
flags.DEFINE_list("batch_sizes", ["256", "1024", "4096"], "Expected B.",)
flags.DEFINE_float("target_epsilon", 8.0, "ε of untruncated Poisson.")
flags.DEFINE_float("delta", 1e-5, "δ.")
flags.DEFINE_float("epochs", 10, "Epochs.")
flags.DEFINE_float("interval", 1e-3, "PLD value discretisation interval.")


def _epsilon(event, count, delta, interval):
  return dp_accounting.pld.PLDAccountant(
      value_discretization_interval=interval).compose(
          event, count).get_epsilon(delta)


def _overflow_and_padding(n, q, rows, carried: bool):
  """P(draw > rows) and the expected masked fraction of the step's rows
  (padded Poisson: carried batches count their rows too)."""
  k = np.arange(n + 1)
  pmf = stats.binom.pmf(k, n, q)
  over = float(pmf[k > rows].sum())
  if carried:
    batches = np.maximum(1, -(-k // rows))
    used = batches * rows
    return over, float(np.sum((used - k) * pmf) / np.sum(used * pmf))
  return over, float(np.sum((rows - np.minimum(k, rows)) * pmf) / rows)


def table(num_examples, batch_sizes, target_epsilon, delta, epochs,
          interval):
  """The markdown lines of the table (module docstring)."""
  n = num_examples
  lines = [
      f"N={n}, {epochs:g} epochs, δ={delta:g}, σ calibrated to ε="
      f"{target_epsilon:g} for untruncated Poisson (PLD, interval "
      f"{interval:g}).", "",
      "| B | σ | sampling | rows per batch | ε | P(draw > rows) per step "
      "| padding (masked rows) |",
      "|---|---|---|---|---|---|---|"]
  for b in batch_sizes:
    q = b / n
    steps = accounting.steps_for(n, b, epochs)
    sigma = accounting.noise_multiplier_for_epsilon(
        target_epsilon, n, b, steps=steps, delta=delta, accountant="pld",
        tolerance=1e-3)
    padded = poisson.default_physical_batch_size(b)
    eps = _epsilon(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(sigma)), steps, delta, interval)
    over, pad = _overflow_and_padding(n, q, padded, carried=True)
    lines.append(f"| {b} | {sigma:.4f} | Poisson, padded + carried | "
                 f"{padded} (+{padded} on overflow) | {eps:.3f} | "
                 f"{over:.2e} | {pad:.1%} |")
    for width in (0, 2, 4):
      rows = int(math.ceil(b + width * math.sqrt(b)))
      eps = _epsilon(dp_accounting.TruncatedSubsampledGaussianDpEvent(
          n, q, rows, sigma), steps, delta, interval)
      over, pad = _overflow_and_padding(n, q, rows, carried=False)
      name = "B" if width == 0 else f"B+{width}√B"
      lines.append(f"| {b} | {sigma:.4f} | truncated, B_max = {name} | "
                   f"{rows} | {eps:.3f} | {over:.2e} | {pad:.1%} |")
  return lines


def main(argv):
  del argv
  print("\n".join(table(
      FLAGS.num_examples, [int(b) for b in FLAGS.batch_sizes],
      FLAGS.target_epsilon, FLAGS.delta, FLAGS.epochs, FLAGS.interval)))


if __name__ == "__main__":
  app.run(main)
