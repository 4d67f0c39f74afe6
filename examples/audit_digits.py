"""A one-run privacy audit of the digits example (`examples/dp_digits.py`).

    python examples/audit_digits.py                             # gradient, ε = 8
    python examples/audit_digits.py --target_epsilon=1          # correct, ε = 1
    python examples/audit_digits.py --break=noise_div_10        # claims ε = 1
    python examples/audit_digits.py --canaries=input            # input canaries

Trains the main example's CNN on its data with m canaries
(`tf_pxg.audit.CanaryCallback`; each "in" with probability 1/2), then prints
the ε the run claims (the accountant's, for the noise the run was
*configured* with) and two one-run lower bounds from the canaries' scores:
Steinke, Nasr and Jagielski's ε-DP bound and Mahloujifar et al.'s Gaussian
f-DP bound (`tf_pxg.audit`). The verdict's bound is wrong with probability
at most the significance: with gradient canaries it is one of the two, each
at the full significance, picked from the claim alone (the f-DP bound when
the accountant implies the Gaussian claim it tests, `gdp_covers`, else the
ε-DP bound); with input canaries the maximum of both, each at
significance/2. A correct mechanism must give `lower bound <= claimed ε`.

`--canaries`:

* `gradient` (default): white-box gradient canaries
  (`CanaryCallback.gradient`): per-example gradients of norm
  `--canary_norm_factor` × C on random coordinates (`--direction=dirac`) or
  random directions, added inside the train step and Poisson-sampled as an
  example is; scored by the released updates' projections (the model is
  trained with plain SGD, so a weight change is the released noisy
  gradient) and their likelihood ratio. This audits the mechanism and
  comes within 2× of the claim at ε = 8: the CNN's convolution is widened
  to 320 filters (`--filters`; 54 410 parameters), one Dirac canary per
  parameter, so that m = 54 410 canaries sit on distinct coordinates
  without interfering, and both bounds test one pre-declared rule, "in"
  for the top 2 % of the scores and "out" for the bottom 2 %
  (`--top_fraction`). 2-3 minutes per run on 2 shared CPU cores.
* `input`: out-of-distribution (or mislabelled) input examples inserted
  into the data, scored by their final loss: audits what the model
  memorises, far below the claim for a correct run.

`--break` trains a deliberately broken mechanism while claiming the same ε
(an audit-only switch, to check that the audit catches it; not a training
option):

* `no_noise`: the noise is switched off (σ = 0);
* `no_clip`: gradients are not clipped (the noise std stays σ·C);
* `noise_div_10`: the noise std is divided by 10.

Broken runs claim ε = 1 unless `--target_epsilon` is given. The last line
states the verdict, `refuted` or `not refuted`, with both numbers;
`--json` writes every number (and the scores).
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402

from dp_digits import cnn_layers  # noqa: E402
from dp_digits import load_data  # noqa: E402
from tf_pxg import accounting  # noqa: E402
from tf_pxg import audit  # noqa: E402
import tf_pxg.keras as dpk  # noqa: E402

_BREAKS = ("none", "no_noise", "no_clip", "noise_div_10")

_BREAK = flags.DEFINE_enum("break", "none", _BREAKS,
                           "Audit-only: train a deliberately broken "
                           "mechanism that claims the same ε.")
_CANARIES = flags.DEFINE_enum("canaries", "gradient", ["gradient", "input"],
                              "White-box gradient canaries or input "
                              "examples (module docstring).")
_NUM_CANARIES = flags.DEFINE_integer(
    "num_canaries", None,
    "m. Default: one Dirac gradient canary per parameter (54 410 for the "
    "CNN with 320 filters), 250 input canaries (the small CNN memorises "
    "few: with the noise removed, 250 gave a larger bound than 500 or "
    "1000, docs/auditing.md).")
_FILTERS = flags.DEFINE_integer(
    "filters", None,
    "The CNN's convolution filters. Default: 320 with gradient canaries "
    "(54 410 parameters, so one Dirac canary per parameter gives m = 54 410: "
    "the bound of a correct run comes within 2x of the claim), 16 (the main "
    "example's CNN, 2730 parameters) with input canaries.")
_TOP_FRACTION_FLAG = flags.DEFINE_float(
    "top_fraction", None,
    "Gradient canaries: the one guess rule, 'in' for the top and 'out' for "
    "the bottom fraction of the scores (TopFraction(f, two_sided=True)). "
    "Fix it before the run. Default 0.02 (module docstring).")
_DIRECTION = flags.DEFINE_enum("direction", "dirac", ["dirac", "random"],
                               "Gradient canaries' directions.")
_CANARY_NORM = flags.DEFINE_float(
    "canary_norm_factor", 100.0,
    "Gradient canaries' norm / C (> 1: a run that does not clip shows it).")
_CANARY = flags.DEFINE_enum("canary", "ood", ["ood", "mislabelled"],
                            "Input canary kind (tf_pxg.audit.canaries).")
_SCORE = flags.DEFINE_enum(
    "score", None, ["loss", "loss_change", "sum", "likelihood"],
    "Canary score; default likelihood (gradient) or loss (input).")
_SGD_LEARNING_RATE = flags.DEFINE_float(
    "sgd_learning_rate", 0.5, "With gradient canaries: plain SGD's rate.")
_ACCOUNTANT = flags.DEFINE_enum(
    "accountant", "rdp", ["rdp", "pld"],
    "The claim's accountant. RDP's ε (8 here) is above the mechanism's PLD "
    "ε (7.3); a PLD claim of ε = 8 (σ = 1.07) is tight but is not implied "
    "to be Gaussian (gdp_covers_claim=False), so the f-DP bound then does "
    "not count in the verdict.")
_SIGNIFICANCE = flags.DEFINE_float("significance", 0.05,
                                   "Probability that the verdict's bound "
                                   "is wrong.")
# The main example's flags, reused: --target_epsilon (the claim; default 8,
# and 1 with --break unless given), --delta, --epochs, --batch_size,
# --learning_rate (Adam, input canaries), --l2_norm_clip, --seed.
# (--noise_multiplier and --nodp do not apply: the noise is chosen for the
# claim.)
FLAGS = flags.FLAGS
_SECURE_MODE = flags.DEFINE_bool("secure_mode", False,
                                 "Noise keys from the OS CSPRNG every step "
                                 "(tf_pxg.dp.secure).")
_JSON = flags.DEFINE_string("json", None, "Write the results here.")


# Gradient canaries' one guess rule, fixed before any label is seen: "in"
# for the top 2 % of the scores and "out" for the bottom 2 %
# (TopFraction(0.02, two_sided=True)). Chosen by simulating the claimed
# mechanism at ε = 8 (Poisson q = 64/1437, 899 steps, σ = 1.121, m = 54 410,
# the likelihood score, the f-DP bound at 0.05) over 16 seeds: of 0.5-5 %,
# one- and two-sided, it had the largest minimum (4.48; mean 4.75; top 1 %
# two-sided: 4.27 / 4.90, top 5 %: 4.18 / 4.37).
_GRADIENT_FRACTION = 0.02
# Input canaries' f-DP rule (one-sided top 5 %, as before).
_INPUT_FRACTION = 0.05
_GRADIENT_FILTERS, _INPUT_FILTERS = 320, 16


def broken(break_mode, sigma, l2_norm_clip):
  """(clip, noise multiplier) that the run trains with; the claim stays
  (l2_norm_clip, sigma). Audit-only."""
  if break_mode == "no_noise":
    return l2_norm_clip, 0.0
  if break_mode == "no_clip":
    # No clipping, and the noise std stays sigma * l2_norm_clip.
    return 1e9, sigma * l2_norm_clip / 1e9
  if break_mode == "noise_div_10":
    return l2_norm_clip, sigma / 10
  return l2_norm_clip, sigma


def audit_layers(filters):
  """The main example's CNN (`dp_digits.cnn_layers`) with `filters`
  convolution filters (16 there): a wider CNN has more parameters, hence
  room for more Dirac gradient canaries on distinct coordinates."""
  layers = cnn_layers()
  i, conv = next((i, l) for i, l in enumerate(layers)
                 if isinstance(l, keras.layers.Conv2D))
  layers[i] = type(conv).from_config({**conv.get_config(),
                                      "filters": filters})
  return layers


def make_canaries(kind, m, x_train, x_test, y_test, n, batch_size, sigma,
                  score, l2_norm_clip, direction, norm_factor):
  """The `CanaryCallback` for `kind` ("gradient", "ood", "mislabelled")."""
  if kind == "gradient":
    return audit.CanaryCallback.gradient(
        m, norm_factor * l2_norm_clip,
        accounting.sampling_probability(n, batch_size), direction=direction,
        score=score, noise_multiplier=sigma)
  if kind == "ood":
    return audit.CanaryCallback.out_of_distribution(
        m, x_train.shape[1:], 10, low=0.0, high=1.0, score=score)
  # Mislabelled test images: kept out of the training data.
  return audit.CanaryCallback.mislabelled(
      x_test, y_test, min(m, len(x_test)), 10, score=score)


def bounds(auditor, significance, delta, gradient, fraction):
  """(ε-DP bound, f-DP bound).

  Gradient canaries: both bounds test one rule fixed in advance,
  `TopFraction(fraction, two_sided=True)`, each at the full `significance`;
  the verdict (in `run`) uses one of them, chosen from the claim alone:
  the f-DP bound when the accountant implies the Gaussian claim it tests
  (`gdp_covers`), else the ε-DP bound. (The
  ε-DP bound's Bonferroni family of m rules at δ = 1e-5 cannot refute
  anything for m in the thousands: its δ term 2mδ is above the per-rule
  level.) Input canaries keep the Bonferroni families for the ε-DP bound
  (the larger of the one- and two-sided bounds at `significance / 4`
  each) and the f-DP bound of the top `fraction` at `significance / 2`:
  the verdict uses their maximum.
  """
  if gradient:
    rule = audit.TopFraction(fraction, two_sided=True)
    return (auditor.epsilon_one_run(significance, delta,
                                    threshold_strategy=rule),
            auditor.epsilon_one_run_fdp(significance, delta,
                                        threshold_strategy=rule))
  a = significance / 2
  eps = max(auditor.epsilon_one_run(a / 2, delta),
            auditor.epsilon_one_run(a / 2, delta, one_sided=False))
  return eps, auditor.epsilon_one_run_fdp(
      a, delta, threshold_strategy=audit.TopFraction(fraction))


def run(break_mode="none", target_epsilon=8.0, delta=1e-5,
        canaries="gradient", num_canaries=None, canary="ood", score=None,
        significance=0.05, epochs=40, batch_size=64, learning_rate=1e-2,
        secure_mode=False, seed=0, verbose=True, l2_norm_clip=1.0,
        direction="dirac", canary_norm_factor=100.0, sgd_learning_rate=0.5,
        accountant="rdp", filters=None, top_fraction=None):
  """Trains with canaries and returns a dict of the audit's numbers."""
  start = time.time()
  keras.utils.set_random_seed(seed)
  x_train, x_test, y_train, y_test = load_data(seed)
  gradient = canaries == "gradient"
  kind = "gradient" if gradient else canary
  filters = filters or (_GRADIENT_FILTERS if gradient else _INPUT_FILTERS)
  fraction = top_fraction or (_GRADIENT_FRACTION if gradient else
                              _INPUT_FRACTION)
  m = num_canaries or (keras.Sequential(audit_layers(filters)).count_params()
                       if gradient else 250)
  score = score or ("likelihood" if gradient else "loss")
  # Input canaries are examples (counted in N, drawn before σ is chosen);
  # gradient canaries are not: N and q are the data's.
  callback = None
  x_all, y_all = x_train, y_train
  if not gradient:
    callback = make_canaries(kind, m, x_train, x_test, y_test, None,
                             batch_size, None, score, l2_norm_clip,
                             direction, canary_norm_factor)
    x_all, y_all = callback.insert(x_train, y_train)
  n = len(x_all)
  sigma = accounting.noise_multiplier_for_epsilon(
      target_epsilon, n, batch_size, epochs=epochs, delta=delta,
      accountant=accountant)
  if gradient:
    callback = make_canaries(kind, m, x_train, x_test, y_test, n, batch_size,
                             sigma, score, l2_norm_clip, direction,
                             canary_norm_factor)
  clip, noise = broken(break_mode, sigma, l2_norm_clip)
  model = dpk.DPSequential(audit_layers(filters), l2_norm_clip=clip,
                           noise_multiplier=noise,
                           **({"secure_mode": True} if secure_mode else {}))
  optimizer = (keras.optimizers.SGD(sgd_learning_rate) if gradient else
               keras.optimizers.Adam(learning_rate))
  model.compile(optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), metrics=["accuracy"])
  # The claim is accounted apart from the model: a PrivacyCallback attached
  # to it reads its DP plan, i.e. the noise the run adds (with --break, not
  # the claimed σ, and it refuses another). Unattached, given σ, it
  # accounts the configured mechanism (Poisson at rate B / N), and its
  # budget becomes the model's step limit.
  claim = dpk.PrivacyCallback(num_examples=n, batch_size=batch_size,
                              noise_multiplier=sigma, delta=delta,
                              target_epsilon=target_epsilon,
                              accountant=accountant)
  model.set_step_limit(claim.max_steps())
  model.fit(x_all, y_all, batch_size=batch_size, epochs=epochs,
            callbacks=[callback], verbose=0)
  train_seconds = time.time() - start
  auditor = callback.auditor
  _, accuracy = model.evaluate(x_test, y_test, verbose=0)
  claimed = claim.epsilon(int(model.optimizer.iterations.numpy()))
  eps_bound, fdp_bound = bounds(auditor, significance, delta, gradient,
                                fraction)
  event = accounting.dp_event(n, batch_size, sigma, epochs=epochs)
  result = dict(
      break_mode=break_mode, canaries=kind, score=score,
      direction=direction if gradient else None, filters=filters,
      num_params=model.count_params(), top_fraction=fraction,
      claimed_epsilon=claimed, accountant=accountant, delta=delta,
      noise_multiplier_claimed=sigma, noise_multiplier_run=noise * clip
      if break_mode == "no_clip" else noise, l2_norm_clip=clip,
      m=callback.num_canaries, included=callback.num_included,
      num_examples=n, steps=int(model.optimizer.iterations.numpy()),
      significance=significance, epsilon_dp_bound=eps_bound,
      fdp_bound=fdp_bound,
      # Whether the accountant's profile implies the Gaussian claim the f-DP
      # bound tests (tf_pxg.audit.fdp.gdp_covers).
      gdp_covers_claim=audit.gdp_covers(event, claimed, delta),
      auroc=auditor.auroc(), tpr_at_fpr_0_05=auditor.tpr_at_fpr(0.05),
      test_accuracy=float(accuracy), secure_mode=secure_mode,
      train_seconds=train_seconds, seconds=time.time() - start)
  # The f-DP bound refutes a Gaussian claim; it counts only when the
  # accountant implies that claim (else its theorem does not cover a
  # correct run). Gradient canaries: one bound decides, picked from the
  # claim alone (`bounds`); input canaries: the maximum.
  fdp_counts = fdp_bound if result["gdp_covers_claim"] else 0.0
  if gradient:
    best = fdp_counts if result["gdp_covers_claim"] else eps_bound
  else:
    best = max(eps_bound, fdp_counts)
  result["lower_bound"] = best
  result["bound_over_claim"] = best / claimed
  result["refuted"] = best > claimed
  if verbose:
    print("audit: " + " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in result.items()), flush=True)
  result["scores"] = [float(v) for v in callback.scores]
  result["included"] = [bool(v) for v in callback.included]
  return result


def main(argv):
  del argv
  target = FLAGS.target_epsilon
  if not FLAGS["target_epsilon"].present and _BREAK.value != "none":
    target = 1.0
  result = run(_BREAK.value, target, FLAGS.delta, _CANARIES.value,
               _NUM_CANARIES.value, _CANARY.value, _SCORE.value,
               _SIGNIFICANCE.value, FLAGS.epochs, FLAGS.batch_size,
               FLAGS.learning_rate, _SECURE_MODE.value, FLAGS.seed,
               l2_norm_clip=FLAGS.l2_norm_clip, direction=_DIRECTION.value,
               canary_norm_factor=_CANARY_NORM.value,
               sgd_learning_rate=_SGD_LEARNING_RATE.value,
               accountant=_ACCOUNTANT.value, filters=_FILTERS.value,
               top_fraction=_TOP_FRACTION_FLAG.value)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=1)
  verdict = "refuted" if result["refuted"] else "not refuted"
  covered = ("" if result["gdp_covers_claim"] else
             " (not counted: the claim is not Gaussian)")
  print(f"{verdict}: lower bound {result['lower_bound']:.3f} (ε-DP "
        f"{result['epsilon_dp_bound']:.3f}, f-DP {result['fdp_bound']:.3f}"
        f"{covered}, "
        f"m={result['m']} {result['canaries']} canaries, significance "
        f"{result['significance']:g}) vs claimed ε="
        f"{result['claimed_epsilon']:.3f} (δ={result['delta']:g})")


if __name__ == "__main__":
  app.run(main)
