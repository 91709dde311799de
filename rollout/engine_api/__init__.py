"""How tether talks to engines (SGLang servers and the CPU engine alike), used by rollout and sync.

client.py     EngineClient: SGLang's HTTP API with timeouts, retries and the engine key
auth.py       the engine API key: making, handing over, checking
launch.py     the command lines and process specs that start engines and the router
key_shim.py   runs SGLang with the key kept off its command line
weights.py    the tensor payloads of SGLang's weight-update calls
tool_formats.py  tool calls in model output, in the formats SGLang's parsers name
"""
