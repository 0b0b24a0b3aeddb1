"""How many ranks and nodes an nccl-tests run had: what its text states, checked against busbw / algbw.

nccl-tests derives busbw from algbw with a factor of the rank count n (doc/PERFORMANCE.md, and the *GetBw
functions in src/*.cu, of github.com/NVIDIA/nccl-tests): all_reduce 2(n-1)/n; all_gather, reduce_scatter,
alltoall (n-1)/n; broadcast, reduce, sendrecv 1. The code applies it whatever algorithm NCCL ran (ring, tree,
NVLS, SHARP). Both columns are printed rounded, so each row bounds n to an interval; the rows' common
interval is the count the numbers imply. Only rows with algbw >= 1 GB/s take part (below that two printed
decimals say little); where algbw is not printed it is size / time, its definition. Before 2020-06
all_gather and reduce_scatter printed busbw = algbw (the factor inside algbw): such rows say nothing about n.

The rule (a disagreement is an error naming both numbers):
  1. A stated total must lie in that interval: the caller's nranks, NCCL's own `nranks N` log line,
     'N ranks' / 'world size N', mpirun -np (x -t x -g), 'GPU<N>', and for a one-run file '<N>gpu' in its
     name (the first found, in that order). `-g` alone counts GPUs per process (nccl-tests' meaning), not the
     run's ranks: a log echoing `all_reduce_perf ... -g 1` of an MPI job states no total.
  2. Otherwise the count the ratio pins down. `# Rank i ... on host` lines only bound it from below: logs
     abbreviate that list and nccl-tests itself cuts a long one with '...', so 4 listed ranks under numbers
     that say 16 are read as 16, while 16 listed under numbers that say 4 are an error.
  3. Otherwise a complete list (ranks 0..k-1, nothing elided) gives k; else -g x -t of a command line echoed
     without a launcher (one process), where the numbers allow it; else the count is unknown (None).
Nodes: NCCL's `nNodes N`, the hosts of a list that covers every rank, 'N nodes' / 'N hosts' / 'single node', and for a
one-run file '<N>node' in its name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

# set: the smallest algorithm bandwidth read as a rate
MIN_ALGBW_GBPS = 1.0

# cite: nccl-tests doc/PERFORMANCE.md (bus bandwidth factors)
_FACTOR_SCALE = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}  # c in c(n-1)/n
_RANK_LINE = re.compile(r"\bRank\s+(\d+)\s+(?:Group\s+\d+\s+)?(?:Pid\s+\d+\s+)?on\s+(\S+)\s+device\b")
_ELISION = re.compile(r"(?:\.\.\.|…|\[\.\.\.\]|-*\s*\(?snip\)?\s*-*)", re.IGNORECASE)
_LAUNCHER = re.compile(r"\b(?:mpirun|mpiexec|srun)\b")
_STATED = (  # statements of the total, in order of trust
    r"\b(\d+)\s+ranks?\b",
    r"\bworld[ _]size[\s=:]+(\d+)",
)


class RankCountError(ValueError):
    """The rank count a run states (or lists) contradicts its busbw / algbw ratio."""


@dataclass(frozen=True)
class BandwidthRow:
    """One measurement's printed bandwidths with half a unit of their last printed digit."""

    line: int
    algbw: float
    algbw_err: float
    busbw: float
    busbw_err: float


@dataclass(frozen=True)
class Implied:
    """The rank counts every informative row allows: low..high (high may be inf)."""

    low: int
    high: float
    low_line: int
    high_line: int

    def __contains__(self, n: int) -> bool:
        return self.low <= n <= self.high

    def __str__(self) -> str:
        if self.low == self.high:
            return str(self.low)
        return f"at least {self.low}" if math.isinf(self.high) else f"{self.low}-{int(self.high)}"


def factor_text(collective: str) -> str:
    scale = _FACTOR_SCALE.get(collective)
    return "1" if scale is None else ("2(n-1)/n" if scale == 2 else "(n-1)/n")


def busbw_factor(collective: str, nranks: int) -> float:
    """busbw / algbw of a canonical collective name on nranks ranks (see the module docstring)."""
    scale = _FACTOR_SCALE.get(collective)
    return 1.0 if scale is None else scale * (nranks - 1) / nranks


def implied_ranks(collective: str, rows: Sequence[BandwidthRow]) -> Implied | None:
    """The rank counts the rows' busbw / algbw allow; None when the rows say nothing about n."""
    scale = _FACTOR_SCALE.get(collective)
    low, high, low_line, high_line = 1.0, math.inf, 0, 0
    ratio_one = True  # every row within rounding of busbw = algbw
    for row in rows:
        if not (row.algbw - row.algbw_err >= MIN_ALGBW_GBPS) or not math.isfinite(row.busbw):
            continue
        r_low = (row.busbw - row.busbw_err) / (row.algbw + row.algbw_err) * (1 - 1e-9)
        r_high = (row.busbw + row.busbw_err) / (row.algbw - row.algbw_err) * (1 + 1e-9)
        ratio_one &= r_low <= 1.0 <= r_high
        if scale is None and not ratio_one:
            raise RankCountError(f"line {row.line}: busbw / algbw = {row.busbw / row.algbw:.4g}, but "
                                 f"{collective}'s factor is 1 (nccl-tests doc/PERFORMANCE.md); expected "
                                 f"busbw = algbw (is the collective right?)")
        n_low, n_high = _n_of(scale or 1, r_low), _n_of(scale or 1, r_high)
        if n_low > low or not low_line:
            low, low_line = max(low, n_low), row.line
        if n_high < high or not high_line:
            high, high_line = min(high, n_high), row.line
    if scale is None or not low_line or (scale == 1 and ratio_one):
        return None  # factor 1; or nccl-tests before 2020-06 (all_gather.cu, reduce_scatter.cu) printed busbw = algbw
    if math.isinf(low) or math.ceil(low - 1e-9) > high + 1e-9:
        raise RankCountError(f"busbw / algbw fits no rank count n for {collective} (busbw = algbw * "
                             f"{factor_text(collective)}, nccl-tests doc/PERFORMANCE.md): line {low_line} needs "
                             f"n >= {low:.2f}, line {high_line} n <= {high:.2f}; expected one n for every row "
                             "(is the collective right?)")
    return Implied(math.ceil(low - 1e-9), high if math.isinf(high) else math.floor(high + 1e-9), low_line, high_line)


def _n_of(scale: int, ratio: float) -> float:
    """Invert ratio = scale (n-1) / n."""
    return math.inf if ratio >= scale else scale / (scale - ratio)


@dataclass(frozen=True)
class _RankList:
    ranks: dict[int, str]  # rank -> host
    elided: bool

    @property
    def lower_bound(self) -> int:
        return max(self.ranks) + 1 if self.ranks else 0

    @property
    def complete(self) -> bool:
        return bool(self.ranks) and not self.elided and set(self.ranks) == set(range(len(self.ranks)))


def _rank_list(text: Sequence[tuple[int, str]]) -> _RankList:
    ranks: dict[int, str] = {}
    elided = False
    for _, line in text:
        matches = list(_RANK_LINE.finditer(line))  # several where interleaved output joined rank lines
        for match in matches:
            ranks[int(match.group(1))] = match.group(2)
        if matches:
            elided |= line.rstrip().endswith("...")
        elif ranks and _ELISION.fullmatch(line.strip()):
            elided = True
    return _RankList(ranks, elided)


def _find(pattern: str, text: Sequence[tuple[int, str]], flags: int = 0) -> tuple[int, str] | None:
    """The first count the pattern captures and where: "'<match>' (line N)"."""
    for lineno, line in text:
        match = re.search(pattern, line, flags)
        if match:
            value = next(g for g in match.groups() if g is not None)
            return int(value), f"'{match.group(0).strip()}' (line {lineno})"
    return None


def _single(pattern: str, logs: Sequence[str]) -> int | None:
    values = {int(m.group(1)) for line in logs for m in re.finditer(pattern, line)}
    return values.pop() if len(values) == 1 else None


def _stated_ranks(text: Sequence[tuple[int, str]], logs: Sequence[str], filename: str | None,
                  override: int | None) -> tuple[int, str] | None:
    """A stated total rank count and where it was stated (see the rule in the module docstring)."""
    if override is not None:
        return override, f"nranks={override} (given)"
    from_log = _single(r"\bn[Rr]anks[\s=:]+(\d+)", logs)
    if from_log is not None:
        return from_log, f"NCCL's log (nranks {from_log})"
    for pattern in _STATED:
        found = _find(pattern, text, re.IGNORECASE)
        if found:
            return found
    threads = (_find(r"(?:^|\s)-t\s+(\d+)", text) or (1, ""))[0]
    gpus = _find(r"(?:^|\s)-g\s+(\d+)", text)
    processes = _find(r"(?:^|\s)-np\s+(\d+)", text)  # not -n: that is nccl-tests' iteration count
    if processes:
        return processes[0] * threads * (gpus[0] if gpus else 1), processes[1]
    named = _find(r"(?<![A-Za-z])GPU(\d+)", text)
    if named:
        return named
    if filename:
        match = re.search(r"(?<![a-z0-9])(\d+)[-_]?gpus?(?![a-z])", filename, re.IGNORECASE)
        if match:
            return int(match.group(1)), f"the file name ({filename})"
    return None


def _per_process(text: Sequence[tuple[int, str]]) -> int | None:
    """Ranks of one nccl-tests process (-g GPUs x -t threads) where its command line is echoed without a
    launcher: the total of a run started without MPI. Under mpirun or srun (whose line a log often leaves out)
    -g counts GPUs per process, not the run's ranks, so it states no total on its own."""
    gpus = _find(r"(?:^|\s)-g\s+(\d+)", text)
    if gpus is None or any(_LAUNCHER.search(line) for _, line in text):
        return None
    return gpus[0] * (_find(r"(?:^|\s)-t\s+(\d+)", text) or (1, ""))[0]


def run_counts(collective: str, rows: Sequence[BandwidthRow], text: Sequence[tuple[int, str]],
               logs: Sequence[str], filename: str | None = None,
               override: int | None = None) -> tuple[int | None, int | None]:
    """(nranks, nodes) of one run; RankCountError when what it states and what its numbers imply disagree.

    text: (line number, comment or plain line) of the run's header; logs: its NCCL/SHARP log lines;
    filename: the file's name when the file holds this run only (a name speaks for the whole file).
    """
    implied = implied_ranks(collective, rows)
    stated = _stated_ranks(text, logs, filename, override)
    listed = _rank_list(text)
    rule = f"busbw = algbw * {factor_text(collective)}, nccl-tests doc/PERFORMANCE.md"
    where_implied = ""
    if implied:
        lines = sorted({implied.low_line, implied.high_line})
        where_implied = f"row{'s' * (len(lines) > 1)} at line{'s' * (len(lines) > 1)} {' and '.join(map(str, lines))}"
    if implied and listed.lower_bound > implied.high:
        raise RankCountError(f"the header lists ranks up to {listed.lower_bound - 1} ({listed.lower_bound} ranks), "
                             f"but busbw / algbw implies {implied} ({rule}; {where_implied})")
    if stated:
        nranks, where = stated
        if implied and nranks not in implied:
            raise RankCountError(f"{where} says {nranks} ranks, but busbw / algbw implies {implied} ({rule}; "
                                 f"{where_implied}); expected the two to agree (if the header is wrong, give the "
                                 "real count: nranks=, or num_ranks in its hardware.calibration.files entry)")
        if nranks < listed.lower_bound:
            raise RankCountError(f"{where} says {nranks} ranks, but the header lists {listed.lower_bound}")
    elif implied and implied.low == implied.high:
        nranks = implied.low  # above the listed ranks (checked): the list is partial
    elif listed.complete and (implied is None or len(listed.ranks) in implied):
        nranks = len(listed.ranks)
    elif (per_process := _per_process(text)) is not None and (implied is None or per_process in implied):
        nranks = per_process  # -g x -t of one process (no launcher echoed), where the numbers allow it
    else:
        nranks = None
    covered = nranks is not None and set(listed.ranks) == set(range(nranks))  # every rank and its host listed
    return nranks, _nodes(text, logs, filename, set(listed.ranks.values()) if covered else None)


def _nodes(text: Sequence[tuple[int, str]], logs: Sequence[str], filename: str | None,
           hosts: set[str] | None) -> int | None:
    from_log = _single(r"\bnNodes[\s=:]+(\d+)", logs)
    if from_log is not None:
        return from_log
    if hosts:
        return len(hosts)
    stated = _find(r"\b(\d+)\s*(?:nodes?|hosts)\b", text, re.IGNORECASE)  # "(same 16 ranks on the same 2 hosts)"
    if stated:
        return stated[0]
    if any(re.search(r"\b(?:single|one)[- ]node\b", line, re.IGNORECASE) for _, line in text):
        return 1
    match = re.search(r"(?<![a-z0-9])(\d+)[-_]?nodes?(?![a-z])", filename or "", re.IGNORECASE)
    return int(match.group(1)) if match else None
