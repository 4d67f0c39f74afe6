"""The fork server that runs each private-search run in a fresh process.

Started once per caller process (`python -m tf_pxg.tuning._fork_server`,
by `tf_pxg.tuning.isolation`): it sets the caller's `sys.path`, imports
TensorFlow, Keras and tf_pxg (no op runs here), then for each request
forks a child that runs the job and answers through a pipe. Unlike
`multiprocessing`'s fork server and spawn, it never imports the caller's
`__main__` (a script without an `if __name__ == "__main__"` guard would
run again there). Its own descriptors 1 and 2 go to /dev/null from the
start; the protocol uses a duplicate of the stdout it was given.

Protocol (each message: an 8-byte big-endian length, then a pickle):
request `(payload, workdir)`, answer `(status, value)` as
`tf_pxg.tuning.isolation._child_main` returns it.
"""

from __future__ import annotations

import os
# Python's documented exit of a forked child without the parent's cleanup
# (atexit handlers, buffered streams): os._exit.
from os import _exit as exit_forked_child
import sys

from tf_pxg.tuning._wire import read_message, write_message


def _serve(requests: int, answers: int) -> None:
  from tf_pxg.tuning import isolation  # noqa: PLC0415
  while True:
    request = read_message(requests)
    if request is None:
      return
    payload, workdir = request
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the run
      os.close(read_end)
      os.close(requests)
      os.close(answers)
      write_message(write_end, isolation.child_main(payload, workdir))
      exit_forked_child(0)
    os.close(write_end)
    answer = read_message(read_end)
    os.close(read_end)
    os.waitpid(pid, 0)
    if answer is None:
      answer = ("error", "the run's process ended without an answer")
    write_message(answers, answer)


def main() -> None:
  requests, answers = 0, os.dup(1)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)
  sys.path[:] = read_message(requests)
  for module in ("tensorflow", "keras", "tf_pxg.keras",
                 "tf_pxg.tuning.search"):
    __import__(module)
  _serve(requests, answers)


if __name__ == "__main__":
  main()
