"""Synthetic engines for demos, benchmarks and tests: ``kvbus fleet`` (:mod:`kvbus.simulator.fleet`),
replicas that publish KV events over ZMQ exactly as vLLM and SGLang do, encoded by
:mod:`kvbus.simulator.engine_wire` in any engine format the bridge reads. No kvbus stage imports it."""
