"""The pipeline on the secured stack (issue 12): bridges, the Faust worker and the sink run as
processes, each as its stage's principal with the env file ``infra/stack up --secure`` wrote
(SASL_SSL Kafka with least-privilege ACLs, TLS Redis with ACL users, a registry requiring
credentials for writes), and ``kvbus lookup`` as the router sees the view the open stack's
end-to-end test sees. A stage run as the wrong principal stops with the setting to fix."""
from __future__ import annotations

import json
import uuid

import pytest

from kvbus.children import free_port
from kvbus.infra.secure_plan import ANALYTICS, BRIDGE, ROUTER, SINK, STREAMS
from kvbus.simulator.fleet import Fleet, FleetConfig
from kvbus.sinks.config import SinkConfig
from tests.pipeline import eventually
from tests.secure_stack import StagePipeline
from tests.test_end_to_end import HASHES, SCRIPT

# the secured stack is a session fixture: its tests share one worker under pytest-xdist
pytestmark = [pytest.mark.secure, pytest.mark.xdist_group("secure")]

EXPECTED = {
    "replica-0": {"matched": 3, "tiers": {"GPU": 3}},
    "replica-1": {"matched": 4, "tiers": {"GPU": 2, "CPU": 4, "CPU@kvcr": 4}},
}


@pytest.fixture
def stages(secure_stack, tmp_path):
    p = StagePipeline(secure_stack, tmp_path)
    yield p
    p.stop()


def view_prefix() -> str:
    """A view of this test's own inside the sink's and router's Redis key space (``kvbus:*``)."""
    return f"{SinkConfig().prefix}e2e{uuid.uuid4().hex[:8]}:"


def test_the_pipeline_runs_with_least_privilege_users_and_the_router_sees_the_view(stages, tmp_path):
    prefix = view_prefix()
    fleet = Fleet(FleetConfig(replicas=3, base_port=0, format="vllm-0.33")).start()
    try:
        stages.start("sink", SINK, "sink", "--prefix", prefix)
        stages.start("worker", STREAMS, "worker", "--workdir", str(tmp_path))
        for s in fleet.streams():
            stages.start(f"bridge-{s.replica}", BRIDGE, "bridge", "--endpoint", s.endpoint,
                         "--replay-endpoint", s.replay_endpoint, "--replica", s.replica)
        fleet.play(SCRIPT)
        hashes = ",".join(str(int.from_bytes(h, "big")) for h in HASHES)

        def answer():
            out = stages.run(ROUTER, "lookup", "--json", "--hashes", hashes, "--prefix", prefix)
            if out.returncode != 0:  # the sink has not loaded the view's functions yet
                return None
            got = json.loads(out.stdout.strip().splitlines()[-1])
            seen = {k: {"matched": v["matched"], "tiers": v["tiers"]} for k, v in got.items()}
            return got if seen == EXPECTED else None

        got = eventually(answer, 180, stages)
        assert set(got) == set(EXPECTED)
    finally:
        fleet.stop()


def test_a_sink_run_as_the_bridge_stops_naming_the_redis_user_setting(stages):
    out = stages.run(BRIDGE, "sink", "--prefix", view_prefix(), timeout=90)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "KVBUS_REDIS_USERNAME" in out.stderr
    assert not any(open(f).read().strip() in out.stdout + out.stderr
                   for f in (stages.layout.password_file(p) for p in (BRIDGE, SINK)))


def test_a_lookup_with_a_wrong_password_stops_naming_the_password_setting(stages, tmp_path):
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    out = stages.run(ROUTER, "lookup", "--json", "--hashes", "1,2", "--prefix", view_prefix(),
                     KVBUS_REDIS_PASSWORD_FILE=str(wrong))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "KVBUS_REDIS_PASSWORD" in out.stderr and "not-the-password" not in out.stderr


# Found running stages as the wrong principal on the secured stack (issue 12, client side); each
# stage now checks Kafka and the registry at start and exits 2 naming the KVBUS_* setting to check.


def test_a_bridge_with_a_wrong_kafka_password_names_the_password_setting(stages, tmp_path):
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    code, out = stages.watch(BRIDGE, ("bridge", "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--replica", "r0"),
                             None, 30, KVBUS_KAFKA_SASL_PASSWORD_FILE=str(wrong))
    assert code == 2 and "KVBUS_KAFKA_SASL_PASSWORD" in out and "not-the-password" not in out, out[-2000:]
    assert "Traceback" not in out


def test_a_bridge_run_as_analytics_names_the_registry_user_setting(stages):
    code, out = stages.watch(ANALYTICS, ("bridge", "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--replica", "r0"),
                             None, 30)
    assert code == 2 and "KVBUS_REGISTRY_USERNAME" in out and "Traceback" not in out, out[-2000:]


def test_a_worker_without_kafka_credentials_names_the_protocol_setting(stages, tmp_path):
    code, out = stages.watch(ROUTER, ("worker", "--workdir", str(tmp_path)), None, 30)
    assert code == 2 and "KVBUS_KAFKA_SECURITY_PROTOCOL" in out and "Traceback" not in out, out[-2000:]
