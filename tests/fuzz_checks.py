"""schemathesis checks for the fuzz run (loaded through SCHEMATHESIS_HOOKS by test_fuzz.py):
besides `not_a_server_error`, every error answer is OpenAI's error shape, or Anthropic's on its
paths (/v1/messages...)."""
import schemathesis


@schemathesis.check
def openai_error_shape(ctx, response, case):
    if response.status_code < 400:
        return None
    body = response.json()
    if case.path.startswith("/v1/messages"):
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", \
            f"not Anthropic's error shape: {response.text[:300]}"
        err = body["error"]
        assert isinstance(err, dict) and set(err) == {"type", "message"} and err["message"], response.text[:300]
        return None
    assert isinstance(body, dict) and set(body) == {"error"}, f"not OpenAI's error shape: {response.text[:300]}"
    err = body["error"]
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], response.text[:300]
    assert isinstance(err.get("type"), str) and err.get("code") == response.status_code, response.text[:300]
    return None
