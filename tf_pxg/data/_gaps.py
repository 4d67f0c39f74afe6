"""The size of a round of geometric gaps, shared by the NumPy sampler
(`tf_pxg.data.poisson`) and its TF ops (`tf_pxg.data.sampling_ops`), which
import it from here so that neither imports the other."""

import math


def gap_chunk_size(num_examples: int, sampling_rate: float) -> int:
  """Gaps drawn per round: `Nq + 6 sqrt(Nq) + 16` (one round ~always)."""
  mean = num_examples * sampling_rate
  return int(min(num_examples + 1, math.ceil(mean + 6 * math.sqrt(mean) + 16)))
