"""The CPU engine's HTTP endpoints: SGLang's native API, the OpenAI-compatible one, their shared state and refusals, SSE and tool calls.
May import the scheduler, sampling, the model and the weight receivers."""
