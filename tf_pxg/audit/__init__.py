"""Empirical privacy auditing: ε lower bounds from one training run.

* `CanaryScoreAuditor(in_canary_scores, out_canary_scores)`: the one-run
  ε-DP bound of Steinke, Nasr and Jagielski (2023) (`epsilon_one_run`),
  the one-run Gaussian f-DP bound of Mahloujifar, Melis and Chaudhuri
  (2024) (`epsilon_one_run_fdp`, `tf_pxg.audit.fdp`), both under a
  threshold strategy (`Bonferroni`, `Explicit`, `TopFraction`, `Split`,
  `MultiSplit`: `tf_pxg.audit.thresholds`), the classical Clopper-Pearson
  bound (`epsilon_clopper_pearson`), `tpr_at_fpr` and `auroc`. Pure
  NumPy/SciPy/dp-accounting (no TensorFlow).
* `CanaryCallback`: m canaries, each included with probability 1/2, in a
  `fit` run, scored afterwards, returning the auditor. Input canaries
  (examples added to the data: audit the trained model) or gradient
  canaries (per-example gradients added inside the train step: audit the
  mechanism); see `tf_pxg.audit.canaries`.

A lower bound above the claimed ε proves the training is not as private as
claimed; one below it proves nothing. See `docs/auditing.md` and the module
docstrings for the derivations.
"""

import importlib

from tf_pxg.audit.auditor import CanaryScoreAuditor
from tf_pxg.audit.auditor import one_run_epsilon
from tf_pxg.audit.auditor import one_run_p_value
from tf_pxg.audit.fdp import gaussian_mu
from tf_pxg.audit.fdp import gdp_covers
from tf_pxg.audit.fdp import one_run_epsilon_fdp
from tf_pxg.audit.thresholds import Bonferroni
from tf_pxg.audit.thresholds import Explicit
from tf_pxg.audit.thresholds import MultiSplit
from tf_pxg.audit.thresholds import Split
from tf_pxg.audit.thresholds import TopFraction

__all__ = ["Bonferroni", "CanaryCallback", "CanaryScoreAuditor", "Explicit",
           "MultiSplit", "Split", "TopFraction", "gaussian_mu", "gdp_covers",
           "one_run_epsilon", "one_run_epsilon_fdp", "one_run_p_value"]


def __getattr__(name):
  # Keras is imported only when the callback is asked for.
  if name == "CanaryCallback":
    return importlib.import_module("tf_pxg.audit.canaries").CanaryCallback
  raise AttributeError(f"module 'tf_pxg.audit' has no attribute '{name}'")
