"""A minimal SGLang-shaped engine served by uvicorn, SGLang's own HTTP server.

It answers the routes the manager reads to attach an external engine (health, model and server
info, loads) and ``/generate``, plain or as server-sent events, so that tests can drive the
router's HTTP/1.1 client against uvicorn's keep-alive and chunked streaming rather than only
against servers written for the tests. No model: each answer is ``max_new_tokens`` letters.

Run: ``python -m uvicorn _uvicorn_engine:app --app-dir tests --port P --timeout-keep-alive 1``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "sim-model"


async def health(_: Request) -> Response:
    return JSONResponse({})


async def model_info(_: Request) -> Response:
    return JSONResponse({"model_path": MODEL, "is_generation": True, "weight_version": "default"})


async def server_info(_: Request) -> Response:
    return JSONResponse({"max_total_num_tokens": 16384, "max_running_requests": 64, "weight_version": "default"})


async def loads(_: Request) -> Response:
    load = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_total_tokens": 16384, "num_used_tokens": 0}
    return JSONResponse({"loads": [load]})


def meta(done: int) -> dict[str, object]:
    return {"completion_tokens": done, "prompt_tokens": 2, "weight_version": "default"}


async def generate(request: Request) -> Response:
    body = await request.json()
    n = int(body.get("sampling_params", {}).get("max_new_tokens", 4))
    if not body.get("stream"):
        return JSONResponse({"text": "y" * n, "meta_info": meta(n)})

    async def events() -> AsyncIterator[str]:
        for i in range(1, n + 1):
            yield "data: " + json.dumps({"text": "y" * i, "meta_info": meta(i)}) + "\n\n"
            await asyncio.sleep(0.005)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(
    routes=[
        Route("/health", health),
        Route("/model_info", model_info),
        Route("/get_model_info", model_info),
        Route("/server_info", server_info),
        Route("/get_server_info", server_info),
        Route("/v1/loads", loads),
        Route("/generate", generate, methods=["POST"]),
    ]
)
