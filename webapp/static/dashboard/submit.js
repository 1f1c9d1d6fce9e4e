// The submit form: a prompt or chat messages, max tokens, temperature; on success the
// page opens the new job, which streams.
import { api } from "./api.js";

function showMode(formNode) {
  const mode = formNode.elements.mode.value;
  for (const label of formNode.querySelectorAll("[data-mode]")) {
    label.hidden = label.dataset.mode !== mode;
  }
}

function body(formNode) {
  const values = formNode.elements;
  const request = {
    model: values.model.value,
    max_tokens: Number(values.max_tokens.value),
    temperature: Number(values.temperature.value),
  };
  if (values.mode.value === "chat") {
    request.messages = [];
    if (values.system.value.trim()) {
      request.messages.push({ role: "system", content: values.system.value });
    }
    request.messages.push({ role: "user", content: values.user.value });
  } else {
    request.prompt = values.prompt.value;
  }
  return request;
}

export function setupSubmit() {
  const formNode = document.getElementById("submit-form");
  const errorBox = document.getElementById("submit-error");
  formNode.addEventListener("change", () => showMode(formNode));
  formNode.addEventListener("submit", async (event) => {
    event.preventDefault();
    errorBox.hidden = true;
    const button = formNode.querySelector("button[type=submit]");
    button.disabled = true;
    try {
      const job = await api("/v1/jobs", { method: "POST", body: body(formNode) });
      location.hash = `#/jobs/${job.id}`;
    } catch (error) {
      errorBox.textContent = error.message;
      errorBox.hidden = false;
    } finally {
      button.disabled = false;
    }
  });
}
