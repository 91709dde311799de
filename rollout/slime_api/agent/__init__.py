"""`slime.agent`: slime's agent API: the adapters an agent talks to (adapters/), the session
trajectory (trajectory.py), model-output parsing (parsing.py), sandboxes (sandbox.py), coding-agent
harnesses (harness/) and the threaded aiohttp runner (aiohttp_threaded.py). May import
tether.rollout.engine_api, tether.rollout.openai_turns, tether.rollout.cpu_engine.http.tool_calls
and tether.rollout.slime_api."""
