"""A launch line as users paste it: shell continuations, and a launcher (torchrun, python -m ...) before the
training script whose own options say how many GPUs run it.

`torchrun --nnodes 16 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 8 ...` gives the world
size 128 and the script's arguments; a line without a script (`--tensor-model-parallel-size 8 ...`) is all
script arguments.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from trainsim.errors import ConfigError

LAUNCHER_GPUS = {"--nproc-per-node": "per_node", "--nproc_per_node": "per_node", "--nnodes": "nodes"}
"""torchrun options that size the job: processes (GPUs) per node and nodes."""


def launch_tokens(line: str | Sequence[str]) -> tuple[list[str], int | None]:
    """(the training script's arguments, the world size the launcher gives or None)."""
    if isinstance(line, str):
        tokens = shlex.split(line.replace("\\\n", " "))
    else:
        tokens = list(line)
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py") and not t.startswith("-")), None)
    if script is None:
        return tokens, None
    sizes: dict[str, int] = {}
    launcher = tokens[:script]
    for i, token in enumerate(launcher):
        flag, _, inline = token.partition("=")
        if flag in LAUNCHER_GPUS:
            value = inline or (launcher[i + 1] if i + 1 < len(launcher) else "")
            if not value.isdigit():
                raise ConfigError(f"launcher option {flag} {value!r}: import-layout needs a fixed count (an elastic "
                                  f"range or 'gpu' cannot size the job); pass --gpus N")
            sizes[LAUNCHER_GPUS[flag]] = int(value)
    world = sizes["per_node"] * sizes.get("nodes", 1) if "per_node" in sizes else None
    return tokens[script + 1:], world
