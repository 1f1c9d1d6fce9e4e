"""The API contract: every request and response body as a pydantic model, one module per
surface (`jobs`, `openai`, `service`), the error shape (`errors`). The web app validates
with them and generates `/openapi.json` from them."""
