"""`tf-pxg`: privacy budgeting from the command line.

    tf-pxg epsilon --num_examples=60000 --batch_size=256 \\
        --noise_multiplier=1.1 --epochs=60 [--delta=1e-5] [--accountant=rdp] \\
        [--min_separation=1] [--max_batch_size=B_MAX] [--risk]
    tf-pxg noise --target_epsilon=3 --num_examples=60000 --batch_size=256 \\
        --epochs=60 [--delta=1e-5] [--accountant=rdp] [--tolerance=1e-4] \\
        [--min_separation=1] [--max_batch_size=B_MAX]

    tf-pxg build-native [--cache_dir=DIR] [--force | --check]

`epsilon` prints ε of a DP-SGD run (`tf_pxg.accounting.compute_epsilon`);
`noise` prints the smallest noise multiplier that reaches a target ε
(`tf_pxg.accounting.noise_multiplier_for_epsilon`). Give exactly one of
`--epochs` and `--steps`. `--min_separation=b` (default 1, DP-SGD)
accounts b-min-separation participation: correlated noise with a b-banded
strategy (BandMF, `tf_pxg.mf`) and cyclic Poisson sampling over b groups,
ceil(steps / b) compositions at rate B * b / N
(`docs/correlated_noise.md`); b must be <= N // B. `--num_bands` is its
deprecated name (still accepted; errors then name it).
`--max_batch_size=B_max` accounts truncated Poisson sampling (every step
keeps a random B_max of a larger draw, `fit(max_batch_size=...)`):
dp-accounting's `TruncatedSubsampledGaussianDpEvent` per step, always by
PLD (its RDP has no analysis of it; with `--accountant=rdp` a warning on
stderr says so); only with `--min_separation=1`. The result
is printed alone on stdout, at full precision, so scripts can capture it.
`epsilon --risk` prints three more lines after ε, `mu_gdp=...`,
`tpr_at_fpr_0.001=...` and `tpr_at_fpr_0.01=...`: the same run's μ-GDP
(the dominating Gaussian fit at --delta; exact for unsampled Gaussians)
and the best membership attack's TPR at those FPRs, from dp-accounting's
PLD whatever --accountant says (`tf_pxg.risk`; docs/threat_model.md,
"Reading the risk"). The first line stays ε alone.
Bad input prints one line `tf-pxg <command>: error: ...` on stderr and
exits with status 2.
`python -m tf_pxg.cli ...` works the same.

`build-native` compiles tf_pxg's native CPU ops now (`tf_pxg.native.build`)
instead of at their first use, e.g. in a container image's build, and
prints the library's path; it exits with status 1 if the build fails (one
line on stderr saying why; the compiler's output is in the log it names;
the fallback without them is in `tf_pxg.native`'s doc). A failed build is
remembered and not retried; `--force` builds again (also over a built
library). `--check` builds nothing: it prints which ops run natively here
and which fall back, what runs instead and why, and exits with status 0 if
all are native, else 1.

Each command parses its flags into its own `absl.flags.FlagValues`, so
importing this module defines no global flags.
"""

import dataclasses
import sys
from typing import Callable, Dict, List, Optional, Sequence, Union

from absl import app
from absl import flags

from tf_pxg import accounting
from tf_pxg import risk

_PROG = "tf-pxg"
# The old name of --min_separation, still accepted.
_DEPRECATED_SEPARATION = "num_bands"


class _UsageError(Exception):
  """Bad command line: reported as one line on stderr, exit status 2."""


class _HelpRequested(Exception):
  """--help: print the text in the exception on stdout, exit status 0."""


def _define_run_flags(fv: flags.FlagValues) -> None:
  """Flags shared by both commands: the training run."""
  flags.DEFINE_integer(
      "num_examples", None, "Training set size N.", flag_values=fv)
  flags.DEFINE_integer(
      "batch_size", None,
      "Expected batch size B (Poisson sampling rate B/N).", flag_values=fv)
  flags.DEFINE_float(
      "epochs", None,
      "Number of epochs; steps = ceil(epochs * N / B). Exclusive with "
      "--steps.", flag_values=fv)
  flags.DEFINE_integer(
      "steps", None, "Number of optimizer steps. Exclusive with --epochs.",
      flag_values=fv)
  flags.DEFINE_float("delta", 1e-5, "Target delta, 0 < delta < 1.",
                     flag_values=fv)
  flags.DEFINE_enum(
      "accountant", "rdp", list(accounting.ACCOUNTANTS),
      "Privacy accountant: rdp (Renyi DP) or pld (privacy loss "
      "distributions, tighter).", flag_values=fv)
  flags.DEFINE_integer(
      "min_separation", 1,
      "b of b-min-separation participation: the bands of the BandMF "
      "correlated-noise strategy and the number of cyclic Poisson sampling "
      "groups (sampling rate B*b/N, ceil(steps/b) compositions); 1 is "
      "DP-SGD. At most N // B.", flag_values=fv)
  flags.DEFINE_integer(
      "max_batch_size", None,
      "B_max of truncated Poisson sampling: steps whose Poisson draw is "
      "larger keep a random B_max of it (TruncatedSubsampledGaussianDpEvent, "
      "accounted with PLD). Unset: no truncation.", flag_values=fv)
  flags.DEFINE_integer(
      _DEPRECATED_SEPARATION, None,
      "Deprecated name of --min_separation.", flag_values=fv)
  for name in ("num_examples", "batch_size"):
    flags.mark_flag_as_required(name, flag_values=fv)


def _epsilon_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  _define_run_flags(fv)
  flags.DEFINE_float(
      "noise_multiplier", None,
      "Noise std divided by the clipping norm (sigma).", flag_values=fv)
  flags.mark_flag_as_required("noise_multiplier", flag_values=fv)
  flags.DEFINE_bool(
      "risk", False,
      "Also print the run's mu-GDP (mu_gdp=...) and the best membership "
      "attack's TPR at FPR 1e-3 and 1e-2 (tpr_at_fpr_...=...), from "
      "dp-accounting's PLD, after epsilon.", flag_values=fv)
  return fv


def _noise_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  _define_run_flags(fv)
  flags.DEFINE_float("target_epsilon", None, "The epsilon to reach.",
                     flag_values=fv)
  flags.DEFINE_float("tolerance", 1e-4,
                     "Absolute tolerance on the noise multiplier.",
                     flag_values=fv)
  flags.mark_flag_as_required("target_epsilon", flag_values=fv)
  return fv


def _run_epsilon(fv: flags.FlagValues) -> Union[float, str]:
  run = dict(num_examples=fv.num_examples, batch_size=fv.batch_size,
             noise_multiplier=fv.noise_multiplier, epochs=fv.epochs,
             steps=fv.steps, **_separation(fv))
  epsilon = accounting.compute_epsilon(delta=fv.delta,
                                       accountant=fv.accountant, **run)
  if not fv.risk:
    return epsilon
  # The same event compute_epsilon composes (tf_pxg.accounting.dp_event).
  found = risk.event_risk(accounting.dp_event(**run), fv.delta)
  how = ("exact" if found.exact else
         f"dominating Gaussian fit at delta={fv.delta:g}")
  lines = [repr(epsilon), f"mu_gdp={found.mu!r} ({how})"]
  lines += [f"{key}={value!r}" for key, value in found.logs().items()
            if key != "mu_gdp"]
  return "\n".join(lines)


def _separation(fv: flags.FlagValues) -> dict:
  """`min_separation=` (and `num_bands=` when the deprecated flag was
  given, so that errors name the flag the user typed), and
  `max_batch_size=` when given."""
  given = {"min_separation": fv.min_separation}
  if fv.num_bands is not None:
    given["num_bands"] = fv.num_bands
  if fv.max_batch_size is not None:
    given["max_batch_size"] = fv.max_batch_size
  return given


def _run_noise(fv: flags.FlagValues) -> float:
  return accounting.noise_multiplier_for_epsilon(
      target_epsilon=fv.target_epsilon,
      num_examples=fv.num_examples,
      batch_size=fv.batch_size,
      epochs=fv.epochs,
      steps=fv.steps,
      delta=fv.delta,
      accountant=fv.accountant,
      tolerance=fv.tolerance,
      **_separation(fv))


@dataclasses.dataclass(frozen=True)
class _Command:
  summary: str
  make_flags: Callable[[], flags.FlagValues]
  # The result: a number (printed with repr) or the lines to print.
  run: Callable[[flags.FlagValues], Union[float, str]]


_COMMANDS: Dict[str, _Command] = {
    "epsilon": _Command("print epsilon of a DP-SGD run", _epsilon_flags,
                        _run_epsilon),
    "noise": _Command("print the noise multiplier that reaches an epsilon",
                      _noise_flags, _run_noise),
}

_HELP_ARGS = ("-h", "--help", "-help", "--helpshort", "--helpfull")


_BUILD_NATIVE = "build-native"
_BUILD_NATIVE_HELP = (
    f"usage: {_PROG} {_BUILD_NATIVE} [--cache_dir=DIR] [--force | --check]\n\n"
    "Compile tf_pxg's native ops ahead of time (default cache directory:\n"
    "$TF_PXG_CACHE_DIR, else $XDG_CACHE_HOME/tf_pxg or ~/.cache/tf_pxg)\n"
    "and print the library's path. A failed build is remembered, not\n"
    "retried; --force builds again. --check builds nothing: it lists the\n"
    "ops that run natively here and those that fall back, and why\n"
    "(status 0 if all are native, else 1).")
_BUILD_NATIVE_SWITCHES = ("--force", "--check")


def _build_native(args: Sequence[str]) -> int:
  """`tf-pxg build-native [--cache_dir=DIR] [--force | --check]`."""
  cache_dir, switches = None, set()
  for arg in args:
    if arg in _HELP_ARGS:
      print(_BUILD_NATIVE_HELP)
      return 0
    if arg.startswith("--cache_dir="):
      cache_dir = arg.split("=", 1)[1]
    elif arg in _BUILD_NATIVE_SWITCHES:
      switches.add(arg)
    else:
      return _build_native_usage(f"unexpected argument {arg!r}.")
  if len(switches) > 1:
    return _build_native_usage("give at most one of --force and --check.")
  import logging  # pylint: disable=import-outside-toplevel
  logging.getLogger().setLevel(logging.INFO)
  from tf_pxg import native  # pylint: disable=import-outside-toplevel  (TF)
  if "--check" in switches:
    all_native, lines = native.check(cache_dir=cache_dir)
    print("\n".join(lines))
    return 0 if all_native else 1
  try:
    path = native.build(cache_dir=cache_dir, force="--force" in switches)
  except (OSError, ValueError, native.subprocess.SubprocessError) as e:
    print(f"{_PROG} {_BUILD_NATIVE}: error: {_one_line(str(e))}",
          file=sys.stderr)
    return 1
  print(path)
  return 0


def _build_native_usage(message: str) -> int:
  print(f"{_PROG} {_BUILD_NATIVE}: error: {message}", file=sys.stderr)
  return 2


def _usage() -> str:
  lines = [f"usage: {_PROG} <command> [--flag=value ...]", "", "commands:"]
  lines += [f"  {name:<8} {cmd.summary}" for name, cmd in _COMMANDS.items()]
  lines += [f"  {_BUILD_NATIVE} compile the native ops ahead of time"]
  lines += ["", f"{_PROG} <command> --help lists the command's flags."]
  return "\n".join(lines)


def _parse(argv: Sequence[str]):
  """`argv` (program name first) -> (command name, command, parsed flags)."""
  args = list(argv[1:])
  if not args:
    raise _UsageError(f"no command given; expected one of {_command_list()}.")
  if args[0] in _HELP_ARGS:
    raise _HelpRequested(_usage())
  name, rest = args[0], args[1:]
  if name not in _COMMANDS:
    raise _UsageError(
        f"unknown command {name!r}; expected one of {_command_list()}, "
        f"'{_BUILD_NATIVE}'.")
  command = _COMMANDS[name]
  fv = command.make_flags()
  if any(a in _HELP_ARGS for a in rest):
    raise _HelpRequested(_command_usage(name, command, fv))
  try:
    positional = fv([f"{_PROG} {name}"] + rest)[1:]
  except flags.Error as e:
    raise _UsageError(_one_line(str(e))) from None
  if positional:
    raise _UsageError(f"unexpected argument {positional[0]!r}.")
  if (fv.epochs is None) == (fv.steps is None):
    raise _UsageError(
        "give exactly one of --epochs and --steps; got "
        f"--epochs={fv.epochs}, --steps={fv.steps}.")
  return name, command, fv


def _command_usage(name: str, command: _Command, fv: flags.FlagValues) -> str:
  lines = [f"usage: {_PROG} {name} [--flag=value ...]", "",
           f"{command.summary[0].upper()}{command.summary[1:]}.", "",
           "flags:"]
  for flag_name in sorted(fv):
    flag = fv[flag_name]
    if flag_name in ("epochs", "steps"):
      default = "give --epochs or --steps"
    elif flag_name == _DEPRECATED_SEPARATION:
      default = "default 1, as --min_separation"
    elif flag_name == "max_batch_size":
      default = "default: no truncation"
    elif flag.default is None:
      default = "required"
    else:
      default = f"default {flag.value}"
    lines.append(f"  --{flag_name}: {flag.help} ({default})")
  return "\n".join(lines)


def _command_list() -> str:
  return ", ".join(repr(n) for n in _COMMANDS)


def _one_line(message: str) -> str:
  return " ".join(message.split())


def main(argv: Sequence[str]) -> int:
  """Runs `tf-pxg` on `argv` (program name first); returns the exit status.

  Prints the result on stdout (status 0), help on stdout (status 0), or one
  error line on stderr (status 2). Never raises for bad input.
  """
  if len(argv) > 1 and argv[1] == _BUILD_NATIVE:
    return _build_native(argv[2:])
  name = argv[1] if len(argv) > 1 and argv[1] in _COMMANDS else None
  try:
    _, command, fv = _parse(argv)
    result = command.run(fv)
  except _HelpRequested as e:
    print(str(e))
    return 0
  except (_UsageError, ValueError) as e:
    where = f"{_PROG} {name}" if name else _PROG
    print(f"{where}: error: {_one_line(str(e))}", file=sys.stderr)
    return 2
  print(result if isinstance(result, str) else repr(result))
  return 0


def _absl_flags_parser(argv: List[str]) -> List[str]:
  """For `app.run`: our commands parse their own flags in `main`.

  absl requires its global FLAGS to be parsed; parse only the program name,
  leaving absl's own flags (logging etc.) at their defaults.
  """
  flags.FLAGS(argv[:1])
  return argv


def run(argv: Optional[Sequence[str]] = None) -> None:
  """Console-script entry point (`tf-pxg`); exits with `main`'s status."""
  app.run(main, argv=list(sys.argv if argv is None else argv),
          flags_parser=_absl_flags_parser)


if __name__ == "__main__":
  run()
