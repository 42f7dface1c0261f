"""The official `openai` Python client against `folio serve` (run by tests/serve.rs):
the model list, a chat completion over a saved context (plain and streamed, with the usage),
a follow-up, a method in the `folio` extension, a raw-text completion, and the client's own
exception for each refusal. Usage: openai_client.py BASE_URL (e.g. http://127.0.0.1:8642/v1)."""

import sys

import openai

BASE = sys.argv[1]
CONTEXT = "context:samples"
AMBER = "what is the secret code of amber falcon ?"
AMBER_ANSWER = "the secret code of amber falcon is 4 8 1 5 2 ."

client = openai.OpenAI(base_url=BASE, api_key="not-needed", max_retries=0)

ids = [m.id for m in client.models.list()]
assert CONTEXT in ids, ids

r = client.chat.completions.create(model=CONTEXT, messages=[{"role": "user", "content": AMBER}], temperature=0)
assert r.choices[0].message.content == AMBER_ANSWER, r
assert r.choices[0].finish_reason == "stop", r
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage

stream = client.chat.completions.create(
    model=CONTEXT,
    messages=[{"role": "user", "content": AMBER}],
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
pieces, usage = [], None
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage
assert "".join(pieces) == AMBER_ANSWER, pieces
assert usage and usage.completion_tokens > 5, usage

r = client.chat.completions.create(
    model=CONTEXT,
    messages=[
        {"role": "user", "content": AMBER},
        {"role": "assistant", "content": AMBER_ANSWER},
        {"role": "user", "content": "what is the pass key ?"},
    ],
    temperature=0,
    extra_body={"folio": {"method": "magicpig"}},
)
assert r.choices[0].message.content == "the pass key is 9 0 4 1 7 .", r

bare = ids[0]
r = client.completions.create(model=bare, prompt="the secret code of", max_tokens=3)
assert r.object == "text_completion" and r.usage.completion_tokens <= 3, r

for call, error in [
    (lambda: client.chat.completions.create(model="context:nowhere", messages=[{"role": "user", "content": "hi"}]), openai.NotFoundError),
    (lambda: client.chat.completions.create(model=CONTEXT, messages=[{"role": "user", "content": "hi"}], n=2), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=CONTEXT, messages=[{"role": "user", "content": "hi"}], logprobs=True), openai.BadRequestError),
]:
    try:
        call()
    except error as e:
        assert e.body and e.body.get("message"), e
    else:
        raise AssertionError(f"expected {error.__name__}")

print("openai client: every call answered as expected")
