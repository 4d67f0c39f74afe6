"""Framed pickles over file descriptors: the messages between a private
search and its fork server (`tf_pxg.tuning.isolation`,
`tf_pxg.tuning._fork_server`), in a module of their own so that neither
imports the other for them."""

from __future__ import annotations

import os
import pickle
import struct


def read_message(fd: int):
  """One framed pickle from `fd` (None at end of file)."""
  head = _read_exactly(fd, 8)
  if head is None:
    return None
  body = _read_exactly(fd, struct.unpack(">Q", head)[0])
  return None if body is None else pickle.loads(body)


def write_message(fd: int, obj) -> None:
  data = pickle.dumps(obj)
  view = memoryview(struct.pack(">Q", len(data)) + data)
  while view:
    view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int):
  chunks, left = [], n
  while left:
    chunk = os.read(fd, min(left, 1 << 20))
    if not chunk:
      return None
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)
