"""NIC contention: concurrent inter-node transfers of one rank share its network interface.

On a rail-optimised cluster every GPU has one NIC. When a rank runs k transfers that leave its node at
the same time (the data-parallel gradient all-reduce overlapped with backward, and the pipeline send/recv
of activations or gradients to a stage on another node; later expert all-to-all with DP traffic), each
gets about 1/k of the NIC's bandwidth. The communication model prices every transfer alone, so the
composer adds the sharing here.

Model (fluid fair sharing, per rank = per timeline class). A transfer of solo time f has a
bandwidth-bound part b (f - b is latency, which sharing does not stretch); beta = b / f. Its work is
taken to be spread evenly over its duration, so while k NIC transfers of its class run at once it
advances at 1 / (1 + beta (k - 1)) of its solo speed. A replay shows how long each transfer spent at
each concurrency k (T_k of its replayed duration D); its duration is then the one that finishes its
work f at those speeds:

    d = f * D / (D - sum_k T_k * beta (k - 1) / (1 + beta (k - 1)))

(two equal bandwidth-bound transfers that fully overlap: d = 2 f; alone: d = f). The composer replays
with the new durations until they reproduce themselves, as for overlap slowdown; at the fixed point d is
the fluid fair-share time. The NIC is full duplex: a send uses its egress, a receive its ingress, a
collective both (a ring sends and receives at once), and k counts the transfers on the same direction
(a collective takes the more crowded one), so 1F1B's concurrent send-forward / receive-backward do not
slow each other. Both sides of a transfer end together (a ring advances at its slowest link; a send
completes with its receive), so a synchronisation group takes the largest of its members' durations.

Counted: standalone collectives and P2P transfers whose group spans nodes (NVLink domains, comm/network.py)
and whose time grows with the message (b > 0; a message-independent cost such as TableComm has none).
Left out: communication inside collapsed runs (blocking tensor-parallel collectives, intra-node in the
usual layouts), sharing across ranks at switches, on the node's PCIe or among GPUs of a node that share
a NIC (hardware.network.nics_per_node < devices_per_node), and priority between transfers (every sharer
gets an equal share, even one that would need less).
"""

from __future__ import annotations

import numpy as np


def bandwidth_part(message_seconds: float, tiny_seconds: float) -> float:
    """Bandwidth-bound seconds of a transfer: its time minus that of a 1-byte one on the same ranks."""
    return max(float(message_seconds) - float(tiny_seconds), 0.0)


# set: bit-mask codes
EGRESS, INGRESS, BOTH = 1, 2, 3
"""Directions of the NIC a transfer uses (a bit mask): a send leaves, a receive enters, a collective
(ring, tree, all-to-all) does both at once."""


def contended_durations(cls: np.ndarray, start_s: np.ndarray, duration_s: np.ndarray, fixed_s: np.ndarray,
                        bandwidth_s: np.ndarray, sync_group: np.ndarray | None = None,
                        direction: np.ndarray | None = None) -> np.ndarray:
    """New duration of each NIC transfer given one replay (arrays over the transfers only).

    cls: rank class (the NIC's owner); start_s, duration_s: the replayed interval; fixed_s: solo time f;
    bandwidth_s: its bandwidth-bound part b; sync_group: >= 0 for members of one transfer in several
    classes (they get the largest duration), -1 otherwise; direction: EGRESS / INGRESS / BOTH per
    transfer (default BOTH). The NIC is full duplex, so k counts the transfers using the same direction;
    a collective, which uses both, advances at the pace of the more crowded one. Vectorised: one sort of
    the start and end events of all classes, then per direction and concurrency level present a prefix
    sum of the time spent at it.
    """
    n = len(cls)
    fixed_s = np.asarray(fixed_s, dtype=float)
    out = fixed_s.copy()
    beta = np.clip(np.asarray(bandwidth_s, dtype=float) / np.maximum(fixed_s, 1e-300), 0.0, 1.0)
    live = np.flatnonzero((beta > 0) & (np.asarray(duration_s) > 0))
    if len(live) < 2:
        return out
    c, s = np.asarray(cls)[live], np.asarray(start_s, dtype=float)[live]
    e = s + np.asarray(duration_s, dtype=float)[live]
    way = np.full(len(live), BOTH) if direction is None else np.asarray(direction)[live]
    m = len(live)
    # events sorted by class, then time, ends before starts at the same time (touching is not overlapping);
    # running sums of +1 / -1 per direction are the concurrency after each event, back to 0 at a class's end
    ev_time = np.concatenate([s, e])
    ev_start = np.concatenate([np.ones(m, dtype=bool), np.zeros(m, dtype=bool)])
    ev_cls = np.concatenate([c, c])
    order = np.lexsort((ev_start, ev_time, ev_cls))
    step = np.where(ev_start, 1, -1)[order]
    ev_way = np.concatenate([way, way])[order]
    k_out = np.cumsum(np.where(ev_way & EGRESS, step, 0))[:-1]
    k_in = np.cumsum(np.where(ev_way & INGRESS, step, 0))[:-1]
    t = ev_time[order]
    seg_len = np.where(ev_cls[order][1:] == ev_cls[order][:-1], np.diff(t), 0.0)  # after event j, at k[j]
    position = np.empty(2 * m, dtype=np.int64)
    position[order] = np.arange(2 * m)
    first, last = position[:m], position[m:]
    shortfall = np.zeros(m)  # sum_k T_k beta (k - 1) / (1 + beta (k - 1))
    b = beta[live]
    for w, level in ((EGRESS, k_out), (INGRESS, k_in), (BOTH, np.maximum(k_out, k_in))):
        mine = np.flatnonzero(way == w)
        if not len(mine):
            continue
        for k in np.unique(level[(level >= 2) & (seg_len > 0)]).tolist():
            at_k = np.concatenate([[0.0], np.cumsum(np.where(level == k, seg_len, 0.0))])
            slow = b[mine] * (k - 1)
            shortfall[mine] += (at_k[last[mine]] - at_k[first[mine]]) * slow / (1.0 + slow)
    span = e - s
    out[live] = np.maximum(fixed_s[live] * span / np.maximum(span - shortfall, 1e-300), fixed_s[live])
    if sync_group is not None and n:
        group = np.asarray(sync_group)
        grouped = np.flatnonzero(group >= 0)
        if len(grouped):
            ids, inverse = np.unique(group[grouped], return_inverse=True)
            longest = np.zeros(len(ids))
            np.maximum.at(longest, inverse, out[grouped])
            out[grouped] = longest[inverse]
    return out


def contention_extra(cls: np.ndarray, start_s: np.ndarray, duration_s: np.ndarray, fixed_s: np.ndarray,
                     bandwidth_s: np.ndarray, sync_group: np.ndarray | None = None,
                     direction: np.ndarray | None = None) -> np.ndarray:
    """Seconds each transfer gains from sharing its NIC (contended_durations - fixed_s; >= 0)."""
    return contended_durations(cls, start_s, duration_s, fixed_s, bandwidth_s, sync_group,
                               direction) - np.asarray(fixed_s, dtype=float)
