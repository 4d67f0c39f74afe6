"""A one-run privacy audit of the digits example (`examples/dp_digits.py`).

    python examples/audit_digits.py                        # correct, ε = 8
    python examples/audit_digits.py --target_epsilon=1     # correct, ε = 1
    python examples/audit_digits.py --target_epsilon=1 --break=no_noise

Trains the main example's CNN on its data with m canaries
(`tf_pxg.audit.CanaryCallback`; each in the training set with probability
1/2, counted in N), then prints the ε the run claims (the accountant's, for
the noise the run was *configured* with) and the one-run lower bound of
Steinke, Nasr and Jagielski (2023) from the canaries' losses. A correct
mechanism must give `lower bound <= claimed ε` (with probability at least
1 - significance). `--break` trains a deliberately broken mechanism while
claiming the same ε:

* `no_noise`: the noise is switched off (σ = 0);
* `no_clip`: gradients are not clipped (the noise std stays σ·C);
* `noise_div_10`: the noise std is divided by 10.

For such a run the lower bound should exceed the claim: the audit catches
the bug. With m canaries and δ = 0 the (two-sided) bound cannot exceed about
`logit((0.05 / (m / 2))^(1/m))` (all m guesses right: 3.2 for the default
m = 250, 4.7 for m = 1000),
so break a run that claims a small ε (the default of the broken runs is
ε = 1).

Prints one line `audit: ...` with every number (and `--json` writes them).
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
                           "Train a deliberately broken mechanism.")
_NUM_CANARIES = flags.DEFINE_integer(
    "num_canaries", 250,
    "m. The small CNN memorises few canaries: with the noise removed, 250 "
    "gave a larger bound than 500 or 1000 (docs/auditing.md).")
_CANARY = flags.DEFINE_enum("canary", "ood", ["ood", "mislabelled"],
                            "Canary kind (see tf_pxg.audit.canaries).")
_SCORE = flags.DEFINE_enum("score", "loss", ["loss", "loss_change"],
                           "Canary score.")
_SIGNIFICANCE = flags.DEFINE_float("significance", 0.05,
                                   "Probability that the bound is wrong.")
# The main example's flags, reused: --target_epsilon (the claim; default 8,
# and 1 with --break unless given), --delta, --epochs, --batch_size,
# --learning_rate, --l2_norm_clip, --seed. (--noise_multiplier and --nodp
# do not apply: the noise is chosen for the claim.)
FLAGS = flags.FLAGS
_SECURE_MODE = flags.DEFINE_bool("secure_mode", False,
                                 "Noise keys from the OS CSPRNG every step "
                                 "(tf_pxg.dp.secure).")
_JSON = flags.DEFINE_string("json", None, "Write the results here.")


def run(break_mode="none", target_epsilon=8.0, delta=1e-5, num_canaries=250,
        canary="ood", score="loss", significance=0.05, epochs=40,
        batch_size=64, learning_rate=1e-2, secure_mode=False, seed=0,
        verbose=True, l2_norm_clip=1.0):
  """Trains with canaries and returns a dict of the audit's numbers."""
  start = time.time()
  keras.utils.set_random_seed(seed)
  x_train, x_test, y_train, y_test = load_data(seed)
  if canary == "ood":
    canaries = audit.CanaryCallback.out_of_distribution(
        num_canaries, x_train.shape[1:], 10, low=0.0, high=1.0, score=score)
  else:
    # Mislabelled test images: kept out of the training data.
    canaries = audit.CanaryCallback.mislabelled(
        x_test, y_test, min(num_canaries, len(x_test)), 10, score=score)
  x_all, y_all = canaries.insert(x_train, y_train)
  n = len(x_all)
  sigma = accounting.noise_multiplier_for_epsilon(
      target_epsilon, n, batch_size, epochs=epochs, delta=delta)
  clip, noise = l2_norm_clip, sigma
  if break_mode == "no_noise":
    noise = 0.0
  elif break_mode == "no_clip":
    # No clipping, and the noise std stays sigma * l2_norm_clip.
    clip, noise = 1e9, sigma * l2_norm_clip / 1e9
  elif break_mode == "noise_div_10":
    noise = sigma / 10
  model = dpk.DPSequential(cnn_layers(), l2_norm_clip=clip,
                           noise_multiplier=noise,
                           **({"secure_mode": True} if secure_mode else {}))
  model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), metrics=["accuracy"])
  privacy = dpk.PrivacyCallback(num_examples=n, batch_size=batch_size,
                                noise_multiplier=sigma, delta=delta,
                                target_epsilon=target_epsilon)
  model.fit(x_all, y_all, batch_size=batch_size, epochs=epochs,
            callbacks=[privacy, canaries], verbose=0)
  auditor = canaries.auditor
  _, accuracy = model.evaluate(x_test, y_test, verbose=0)
  result = dict(
      break_mode=break_mode, canary=canary, score=score,
      claimed_epsilon=privacy.epsilon(), delta=delta,
      noise_multiplier_claimed=sigma, noise_multiplier_run=noise * clip
      if break_mode == "no_clip" else noise, l2_norm_clip=clip,
      m=canaries.num_canaries, included=canaries.num_included,
      num_examples=n, steps=int(model.optimizer.iterations.numpy()),
      significance=significance,
      epsilon_lower_bound=auditor.epsilon_one_run(significance, delta),
      epsilon_lower_bound_two_sided=auditor.epsilon_one_run(
          significance, delta, one_sided=False),
      epsilon_clopper_pearson=auditor.epsilon_clopper_pearson(
          significance, delta),
      auroc=auditor.auroc(), tpr_at_fpr_0_05=auditor.tpr_at_fpr(0.05),
      test_accuracy=float(accuracy), secure_mode=secure_mode,
      seconds=time.time() - start)
  best = max(result["epsilon_lower_bound"],
             result["epsilon_lower_bound_two_sided"])
  result["refuted"] = best > result["claimed_epsilon"]
  if verbose:
    print("audit: " + " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in result.items()), flush=True)
  return result


def main(argv):
  del argv
  target = FLAGS.target_epsilon
  if not FLAGS["target_epsilon"].present and _BREAK.value != "none":
    target = 1.0
  result = run(_BREAK.value, target, FLAGS.delta, _NUM_CANARIES.value,
               _CANARY.value, _SCORE.value, _SIGNIFICANCE.value,
               FLAGS.epochs, FLAGS.batch_size, FLAGS.learning_rate,
               _SECURE_MODE.value, FLAGS.seed,
               l2_norm_clip=FLAGS.l2_norm_clip)
  print(f"claimed epsilon={result['claimed_epsilon']:.3f} "
        f"(delta={result['delta']:g}), one-run lower bound="
        f"{result['epsilon_lower_bound']:.3f} (two-sided "
        f"{result['epsilon_lower_bound_two_sided']:.3f}) at significance "
        f"{result['significance']:g} from m={result['m']} canaries: "
        + ("REFUTED: the run is less private than it claims"
           if result["refuted"] else "not refuted (this proves nothing)"))
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
