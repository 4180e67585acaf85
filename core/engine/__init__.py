"""The engine: frontends, the IPC between a frontend and its core, the core loop, and the assembly.

Which module is which (the package is flat so that imports stay stable; the roles are these):

Frontends -- text in, text out; tokenizing, request building and detokenizing happen here:
    llm.py               LLM: the offline, batch API (generate, chat) over an LLMEngine
    llm_engine.py        LLMEngine: the synchronous frontend over an in-process EngineCore
    dp_engine.py         DataParallelLLMEngine: LLMEngine over an executor plugin's replicas
    async_llm.py         AsyncLLM: the asyncio (server) frontend over an engine-core process
    input_processing.py  the one request builder both frontends use (prompt -> engine-core Requests)
    output_processor.py  engine-core outputs -> RequestOutputs (detokenize, stop strings, n > 1)

IPC -- between a frontend process and the engine-core process:
    core_client.py       EngineCoreClient: starts the core process, talks to it over ZMQ
    core_proc.py         the engine-core process: builds an EngineCore and loops over its sockets
    serialization.py     the wire messages (AddRequest, Abort, Ready, Outputs, Fatal) and their encoding
    messages.py          plain messages between scheduler, runner and frontend (SchedulerOutput, ...)

Core loop -- token ids only, no text:
    engine_core.py       EngineCore: schedule, run the model through the executor, apply the results

Assembly -- from an EngineConfig to the parts the core runs:
    builder.py           build_engine / build_engine_parts: every component chosen through the selector
    runner_plugins.py    the model runner's plugins (logits processors, speculator), built with the runner
"""
