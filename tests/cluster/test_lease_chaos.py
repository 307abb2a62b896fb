"""The control plane's chaos script at a small size (CI): two schedulers and three workers, SIGKILLed at
random (a fixed seed), on SQLite and PostgreSQL; nothing lost, doubled, stuck or run twice; every
task end delivered as a signed webhook to a receiver that fails 20% of deliveries.

    schedulers a, b --fire--> tasks --claim--> workers 1..3 --end--> outbox --> relay --> receiver
    (SIGKILL any scheduler, worker or the relay; start it again)
"""

from __future__ import annotations

import pytest

from opgraph.cluster.bench.control_chaos import chaos


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_lease_chaos_small_loses_doubles_and_strands_nothing(backend, tmp_path, request):
    base = str(tmp_path / "sqlite")
    if backend == "postgresql":
        server = request.getfixturevalue("postgres_server")
        server.database()  # the test database exists; chaos() makes a schema of its own in it
        base = server.url("opgraph_tests")
    result = chaos(base, seconds=6, fires=60, seed=11, folder=str(tmp_path), kill_every=(0.8, 1.6))
    assert result["kills"] >= 3, result
    assert (result["lost_fires"], result["doubled_fires"], result["stuck_past_lease"], result["left_open"],
            result["settled_steps_ran_twice"]) == (0, 0, 0, 0, 0), result
    webhooks = result["webhooks"]
    assert webhooks["terminal_events"] >= 20 and webhooks["webhook_failed_answers"] >= 1, webhooks
    assert (webhooks["undelivered_events"], webhooks["unknown_webhook_ids"], webhooks["duplicates_with_new_id"],
            webhooks["retries_with_other_body"], webhooks["bad_signatures"],
            webhooks["ended_tasks_without_event"]) == (0, 0, 0, 0, 0, 0), webhooks
    assert result["fires"] >= 50 and result["ok"]
