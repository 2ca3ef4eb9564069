"""Options of the HTTP server itself (the engine's are EngineArgs)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pagoda import envs

# vLLM's default body cap is unlimited; a public server should refuse giant bodies before parsing them.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class ServerArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 exposes the server to the network.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 = any free port).")
    uds: str | None = Field(None, description="Unix domain socket path to serve on instead of host/port (vLLM's).")
    api_key: str | None = Field(None, description="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY', Anthropic's header) on every path but /health, /ping, /metrics and /version (or PAGODA_API_KEY).")
    served_model_name: list[str] | None = Field(None, description="Names the API answers to; the first is reported.")
    lora_modules: list[str] | None = Field(
        None, description="LoRA adapters served at start (needs --enable-lora): name=path, or vLLM's JSON "
                          "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request's model names one.")
    chat_template: str | None = Field(None, description="Chat template file or inline Jinja for every request.")
    trust_request_chat_template: bool = Field(
        False, description="Accept a request's own chat_template (arbitrary Jinja run on the server's CPU), as vLLM.")
    chat_template_render_timeout: float = Field(
        5.0, ge=0, description="Seconds a chat template may take to render before the request fails (0 = unbounded).")
    enable_auto_tool_choice: bool = Field(
        False, description='Answer tool_choice "auto" by reading tool calls out of the output (needs tool_call_parser).')
    tool_call_parser: str | None = Field(
        None, description="Tool-call parser for tool_choice auto (hermes, llama3_json, mistral, pythonic, ...).")
    tool_parser_plugin: str | None = Field(
        None, description="Python file that registers tool parsers with ToolParserManager.register_module.")
    allowed_origins: list[str] = Field(default_factory=lambda: ["*"], description="CORS allowed origins.")
    allow_credentials: bool = Field(False, description="CORS: allow credentials.")
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"], description="CORS allowed methods.")
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"], description="CORS allowed headers.")
    allowed_hosts: list[str] = Field(
        default_factory=lambda: ["*"],
        description='Host headers the server answers (names, "*.domain", "*" = any, the default as in vLLM); '
                    'others get a 400. Guards a server on localhost against DNS rebinding.')
    max_request_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0, description="Largest request body accepted.")
    max_n: int = Field(128, gt=0, description="Largest n / best_of a request may ask for.")
    responses_store_max_entries: int = Field(
        1000, ge=0, description="Responses (/v1/responses, store true) kept in memory for GET and "
                                "previous_response_id, the least recently used dropped first (0: none kept).")
    uvicorn_log_level: str = Field("info", description="uvicorn's log level.")
    disable_log_requests: bool = Field(True, description="Do not log each request.")
    vllm_metric_names: bool = Field(
        False, description="Export every /metrics metric under vLLM's vllm:* names as well as pagoda:*.")
    disable_log_stats: bool = Field(False, description="Record no engine statistics (vLLM's --disable-log-stats).")
    enable_tokenizer_info_endpoint: bool = Field(
        False, description="Serve GET /tokenizer_info (the tokenizer's configuration and chat template), as vLLM.")
    shutdown_timeout: float = Field(10.0, ge=0, description="Seconds to let in-flight requests finish on SIGINT/SIGTERM.")

    # many models on one port (pagoda's, beyond vLLM; docs/server.md "Many models on one port")
    max_loaded_models: int | None = Field(
        None, gt=0, description="Most models loaded at once; loading another evicts the least recently used idle one.")
    models_memory_budget: int | None = Field(
        None, gt=0, description="Bytes of weights + KV cache the loaded models may hold together; the least recently "
                                "used idle ones are evicted past it.")
    model_idle_timeout: float | None = Field(
        None, ge=0, description="Seconds a model may idle before it unloads (a model's keep_alive, or a request's, "
                                "wins); None = never.")
    max_parked_models: int = Field(
        2, ge=0, description="Evicted or idle models whose engine is kept asleep (its process alive) so the next "
                             "request wakes it instead of loading it; past this many the least recently used "
                             "parked one shuts down. 0 = unload at once, as before parking existed.")
    model_load_timeout: float = Field(
        600.0, gt=0, description="Seconds a request waits for its model to load before a 503 (the load goes on).")

    def resolved_api_key(self) -> str | None:
        return self.api_key or envs.PAGODA_API_KEY
