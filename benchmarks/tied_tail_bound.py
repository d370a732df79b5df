"""How close to ``lockstep-traffic`` an exact run of the transformer can come, given its tied
embedding (issue 16's 0.97 bar; benchmarks/RESULTS.md, stop 37). No training runs here.

The transformer ties its LM head to its token embedding: autograd completes that weight's
gradient only when backward ends, and the next forward's first operation reads it, so its
all-reduce overlaps no compute. A schedule that hid every other byte would still take
``lockstep-traffic + tail`` per iteration, ``tail`` being that all-reduce's time. This reads

* ``lockstep-traffic``'s and scaleout's iteration of a stored ``bench train --json`` run,
* the lone all-reduce line of the testbed at that rate (``LONE_CALLS``: 1 KB and 4 MiB,
  median lone calls, as the simulator's testbed rows use it),

and prints the bound for the weight sent whole and in two shares (``SCALEOUT_SPLIT_TIED=1``:
only the lookup's rows, ``SPLIT_TAIL_BYTES``, after backward, in a codec of two rounds), and
the simulator's what-if of both on the stop-24 testbed row at that rate (priority, early
chunks). Run::

    python3 benchmarks/tied_tail_bound.py \
        benchmarks/results/stop36/status/transformer-1gbit-keep.json 1gbit
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from scaleout.scheduler.config import SchedulerConfig
from scaleout.sim.iteration import IterationConfig, simulate
from scaleout.sim.testbed_cases import (LONE_CALLS, PROBE_BYTES, TESTBED_ROWS, probed_link,
                                        testbed_workload)
from scaleout.sim.workload import Layer

TIED_BYTES = 4096 * 256 * 4  # the transformer's token embedding, float32
SPLIT_TAIL_BYTES = 2.4e6  # its lookup's rows per iteration, 2 ranks (docs/scheduling.md)


def lone_call_s(nbytes: float, rate: str) -> float:
    """A lone all-reduce of ``nbytes`` at ``rate`` (2 ranks): the line through LONE_CALLS."""
    small, large = LONE_CALLS[2, rate]
    return small + (nbytes - PROBE_BYTES[0]) / (PROBE_BYTES[1] - PROBE_BYTES[0]) * (large - small)


def simulated(rate: str) -> dict[str, tuple[float, float]]:
    """(iteration, exposed) ms of the stop-24 testbed row at ``rate``, whole and split."""
    row = next(r for r in TESTBED_ROWS if r[0] == "transformer" and r[1] == 2 and r[2] == rate)
    _, ranks, _, single, _, _, mb, _ = row
    link = probed_link(rate, ranks)
    work = testbed_workload("transformer", single, mb, ranks)
    tok = work.layers[0]
    assert tok.name == "tok_emb", tok.name
    # split: the lookup's rows at the end of backward, the head's share with the last layer
    early = Layer(name="tok_emb.early", forward_s=0.0, backward_s=0.0, grad_bytes=tok.grad_bytes)
    split = replace(work, layers=(replace(tok, grad_bytes=int(SPLIT_TAIL_BYTES)),
                                  *work.layers[1:], early))
    config = IterationConfig(scheduler=SchedulerConfig(policy="priority"), mode="overlap",
                             early_chunks=True, host_s_per_byte=link.cpu_s_per_byte,
                             host_s_per_message=link.cpu_s_per_message)
    out = {}
    for name, workload in (("whole", work), ("split", split)):
        result = simulate(workload, link.topology(), config)
        out[name] = (result.iteration_s * 1e3, result.exposed_s * 1e3)
    return out


def main(path: str, rate: str) -> None:
    with open(path) as f:
        summary = json.load(f)["summary"]
    ceiling = summary["lockstep-traffic"]["iter_ms"]
    measured = summary["scaleout"]["over_peers"]["lockstep-traffic"]
    small = LONE_CALLS[2, rate][0]
    tails = {"whole": lone_call_s(TIED_BYTES, rate) * 1e3,
             "split": (lone_call_s(SPLIT_TAIL_BYTES, rate) + small) * 1e3}
    print(f"lockstep-traffic {ceiling:.1f} ms/it; scaleout measured {measured:.3f} of it")
    for name, tail in tails.items():
        print(f"{name}: tail {tail:.1f} ms -> at most {ceiling / (ceiling + tail):.3f} of "
              f"lockstep-traffic; 0.97 needs an iteration >= {tail / 0.03:.0f} ms")
    for name, (iteration, exposed) in simulated(rate).items():
        print(f"simulated ({name}): {iteration:.1f} ms/it, {exposed:.1f} ms exposed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "1gbit")
