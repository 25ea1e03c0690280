"""Two simulated machines in network namespaces, as the link benchmark runs them.

A few steps of the tiny T5 preset across a 1 Gbit/s veth link: both machines finish, and
FlexDeMo's byte counters agree with what the link itself counted. Skipped, with the reason,
where namespaces cannot be created.
"""

from __future__ import annotations

import sys

import pytest
from support.launch import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "link"))

from link_benchmark import run_one  # noqa: E402
from netns import NamespacePair, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.multiprocess

REASON = unavailable_reason()


@pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
def test_two_namespace_launch_finishes_and_counters_match_the_link(tmp_path):
    with NamespacePair("1gbit", net=232) as pair:
        result = run_one(pair, "demo", steps=4, batch=4, work=tmp_path, port=29577, model_size="tiny")
    assert result["steps"] == 4 and len(result["losses"]) == 4
    counted = result["figures"]["flexdemo/bytes_sent"]
    on_link = result["link_tx_bytes"][0]
    assert counted > 0
    # The link also carries TCP/IP headers, the rendezvous and the Trainer's small gathers.
    assert counted <= on_link <= 1.25 * counted + 300_000, (counted, on_link)
