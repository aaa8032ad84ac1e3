"""Settings travel to child processes through the environment: ``to_env`` is ``from_env``'s inverse."""
from __future__ import annotations

import os

from kvbus.runtime.settings import Settings
from kvbus.schemas.topics import Topics


def test_to_env_gives_a_child_process_the_same_settings(monkeypatch):
    mine = Settings(bootstrap="h1:1,h2:2", registry_url="http://r:1/ccompat", redis_url="redis://x:2/3",
                    partitions=7, topics=Topics(raw="a.raw", blocks="a.blocks", incomplete="a.inc", dlq="a.dlq"),
                    max_record_bytes=12345)
    for key in [k for k in os.environ if k.startswith("KVBUS_")]:
        monkeypatch.delenv(key)
    for key, value in mine.to_env().items():
        monkeypatch.setenv(key, value)
    assert Settings.from_env() == mine
