"""Private hyperparameter selection (Papernot and Steinke, ICLR 2022).

A DP random search: K ~ `TruncatedNegativeBinomial(eta, gamma)` or
`Poisson(mean)` runs (K secret, drawn from the OS CSPRNG), each of a
candidate drawn independently from a fixed prior and trained with DP,
each releasing a private score; only the best run is released, and the
search's ε is dp-accounting's `RepeatAndSelectDpEvent` of the per-run
event. Two front ends:

* `PrivateSearch(candidates, train_fn, score, num_runs, ...)`: a list of
  configurations and a training function (`tf_pxg.tuning.search`);
* `DPTuner(build_model, ...)`: a keras-tuner tuner (`tf_pxg.tuning.tuner`,
  needs `pip install "tf_pxg[tuner]"`; imported on first use).

Accounting both ways: `search_epsilon`, `noise_multiplier_for_search`
(`tf_pxg.tuning.accounting`). Docs: docs/tuning.md.
"""

import importlib

from tf_pxg.tuning.accounting import noise_multiplier_for_search
from tf_pxg.tuning.accounting import search_epsilon
from tf_pxg.tuning.accounting import search_event
from tf_pxg.tuning.distributions import Poisson
from tf_pxg.tuning.distributions import TruncatedNegativeBinomial
from tf_pxg.tuning.scores import NoisyTrainingLoss
from tf_pxg.tuning.scores import PrivateValidation
from tf_pxg.tuning.scores import PublicValidation
from tf_pxg.tuning.search import PrivateSearch
from tf_pxg.tuning.search import SearchError
from tf_pxg.tuning.search import SearchResult
from tf_pxg.tuning.search import dpsgd_run_event

__all__ = [
    "DPTuner",
    "NoisyTrainingLoss",
    "Poisson",
    "PrivateSearch",
    "PrivateValidation",
    "PublicValidation",
    "SearchError",
    "SearchResult",
    "TruncatedNegativeBinomial",
    "dpsgd_run_event",
    "noise_multiplier_for_search",
    "search_epsilon",
    "search_event",
]


def __getattr__(name):
  if name == "DPTuner":  # keras-tuner is an extra: imported on first use
    return importlib.import_module("tf_pxg.tuning.tuner").DPTuner
  raise AttributeError(f"module 'tf_pxg.tuning' has no attribute '{name}'")
