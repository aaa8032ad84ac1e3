"""Redis refusing a kvbus client (issue 12) on a real redis-server with ACL users: a write the
ACL forbids fails as a permission error instead of being dead-lettered as bad events, and the
``kvbus`` command answers a refused login with exit code 2 and the settings to fix."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from kvbus.infra.scratch_redis import RedisServer
from kvbus.schemas.topics import Topics
from kvbus.sinks.view.redis_store import RedisStore
from kvbus.sinks.view.store_url import open_store
from tests.histories import random_streams


@pytest.fixture(scope="module")
def acl_redis():
    """A Redis with the view written by an admin and a read-only user ``ro`` (password ``pw``)."""
    with RedisServer() as srv:
        admin = srv.client()
        RedisStore(admin, "kvbus:").apply(random_streams(1, Topics(blocks="tb"), holders=3, batches=5, pool=5))
        admin.acl_setuser("ro", enabled=True, passwords=["+pw"], keys=["kvbus:*"],
                          commands=["+@read", "+fcall_ro", "+ping", "+info"])
        yield srv


def test_a_write_the_acl_forbids_is_a_permission_error_not_a_dead_letter(acl_redis):
    ro = open_store(acl_redis.url, "kvbus:", load=False, client_kwargs={"username": "ro", "password": "pw"})
    records = random_streams(2, Topics(blocks="tb"), holders=2, batches=3, pool=4)
    with pytest.raises(redis.exceptions.NoPermissionError):
        ro.apply(records)
    assert ro.reader().size()["holders"] == 3, "nothing was written"


@pytest.mark.parametrize("user, password, wants", [
    ("ro", "wrong-Secret-42", "KVBUS_REDIS_PASSWORD"),
    ("ghost", "ghost-Secret-77", "KVBUS_REDIS_USERNAME"),
])
def test_kvbus_lookup_with_refused_credentials_exits_2_naming_the_settings(acl_redis, user, password, wants):
    env = {**os.environ, "KVBUS_REDIS_URL": acl_redis.url, "KVBUS_REDIS_USERNAME": user,
           "KVBUS_REDIS_PASSWORD": password}
    out = subprocess.run([sys.executable, "-m", "kvbus", "lookup", "--hashes", "1"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out
    assert wants in out.stderr and "Traceback" not in out.stderr
    assert password not in out.stderr, "the secret is not logged"


def test_a_read_only_user_can_look_up(acl_redis):
    env = {**os.environ, "KVBUS_REDIS_URL": acl_redis.url, "KVBUS_REDIS_USERNAME": "ro", "KVBUS_REDIS_PASSWORD": "pw"}
    out = subprocess.run([sys.executable, "-m", "kvbus", "lookup", "--hashes", "1", "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("{")
