// lmserve chat page: streams /v1/chat/completions (SSE) and keeps the conversation client-side.
(() => {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const els = {
    log: $("log"),
    messages: $("messages"),
    model: $("model"),
    context: $("context"),
    auth: $("auth"),
    apiKey: $("api-key"),
    system: $("system"),
    maxTokens: $("max-tokens"),
    temperature: $("temperature"),
    composer: $("composer"),
    prompt: $("prompt"),
    send: $("send"),
    stop: $("stop"),
    newChat: $("new-chat"),
    status: $("status"),
  };

  const KEY_STORAGE = "lmserve.apiKey";
  let modelId = null;
  let history = []; // [{role, content}] sent with every request
  let controller = null; // AbortController of the reply being streamed

  function headers(extra = {}) {
    const key = els.apiKey.value.trim();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
  }

  function showAuth(message) {
    els.auth.hidden = false;
    if (message) setStatus(message);
  }

  function setStatus(text) {
    els.status.textContent = text;
  }

  // The message of an OpenAI or Anthropic error envelope ({"error": {"message": ...}}), else the body.
  async function errorMessage(response) {
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      const error = body.error ?? body;
      if (error && typeof error.message === "string") {
        return error.type ? `${error.message} (${error.type})` : error.message;
      }
    } catch {
      // not JSON: fall through to the raw text
    }
    return text.trim() || `${response.status} ${response.statusText}`;
  }

  async function request(path, options = {}) {
    const response = await fetch(path, { ...options, headers: headers(options.headers) });
    if (!response.ok) {
      if (response.status === 401) showAuth("This server requires an API key.");
      throw new Error(await errorMessage(response));
    }
    return response;
  }

  async function loadHealth() {
    try {
      const health = await (await fetch("health")).json();
      if (health.auth_required) showAuth();
    } catch {
      // /health is advisory here; a 401 elsewhere also reveals the key field
    }
  }

  async function loadModel() {
    try {
      const models = await (await request("v1/models")).json();
      const model = models.data?.[0];
      if (!model) throw new Error("the server lists no model");
      modelId = model.id;
      els.model.textContent = model.id;
      els.context.textContent = model.context_window
        ? `${Number(model.context_window).toLocaleString()} tokens context`
        : "";
    } catch (error) {
      els.model.textContent = "model unavailable";
      els.context.textContent = "";
      setStatus(error.message);
    }
  }

  function scrollToEnd(force = false) {
    const { log } = els;
    if (force || log.scrollHeight - log.scrollTop - log.clientHeight < 80) {
      log.scrollTop = log.scrollHeight;
    }
  }

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function addUserMessage(text) {
    const article = element("article", "message user");
    article.append(element("div", "role", "You"), element("div", "content", text));
    els.messages.append(article);
    return article;
  }

  // An assistant message whose reasoning and answer grow as deltas arrive.
  function addAssistantMessage() {
    const article = element("article", "message assistant");
    article.dataset.state = "streaming";
    article.setAttribute("aria-busy", "true"); // announced once complete, not token by token
    const thinking = element("details", "thinking");
    thinking.hidden = true;
    thinking.open = true;
    const summary = element("summary", "", "Thinking…");
    const reasoning = element("div", "reasoning");
    const reasoningText = document.createTextNode("");
    reasoning.append(reasoningText);
    thinking.append(summary, reasoning);
    const answer = element("div", "answer");
    const answerText = document.createTextNode("");
    answer.append(answerText);
    const meta = element("p", "meta");
    article.append(element("div", "role", "Assistant"), thinking, answer, meta);
    els.messages.append(article);
    return {
      article,
      meta,
      get answer() {
        return answerText.data;
      },
      addReasoning(text) {
        thinking.hidden = false;
        reasoningText.appendData(text);
      },
      addAnswer(text) {
        if (!answerText.data && !thinking.hidden) {
          summary.textContent = "Thinking";
          thinking.open = false; // fold the reasoning away once the answer starts
        }
        answerText.appendData(text);
      },
    };
  }

  function addError(text) {
    const node = element("div", "error", text);
    node.setAttribute("role", "alert");
    els.messages.append(node);
    scrollToEnd(true);
  }

  // Yields the data of each server-sent event in the response body.
  async function* sseData(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, newline).replace(/\r$/, "");
        buffer = buffer.slice(newline + 1);
        if (line === "") {
          if (data.length) yield data.join("\n");
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(5).replace(/^ /, ""));
        }
      }
    }
    if (data.length) yield data.join("\n");
  }

  function optionalNumber(input) {
    const value = input.value.trim();
    return value === "" ? undefined : Number(value);
  }

  function requestBody() {
    const system = els.system.value.trim();
    return {
      model: modelId ?? "default",
      messages: system ? [{ role: "system", content: system }, ...history] : history,
      stream: true,
      stream_options: { include_usage: true },
      max_tokens: optionalNumber(els.maxTokens),
      temperature: optionalNumber(els.temperature),
    };
  }

  function setStreaming(streaming) {
    els.send.disabled = streaming;
    els.stop.disabled = !streaming;
  }

  function describe(usage, finishReason, started, firstToken) {
    const parts = [];
    if (usage?.completion_tokens) {
      parts.push(`${usage.completion_tokens} tokens`);
      const seconds = firstToken ? (performance.now() - firstToken) / 1000 : 0;
      if (seconds > 0 && usage.completion_tokens > 1) {
        parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
      }
    }
    if (firstToken) parts.push(`first token ${((firstToken - started) / 1000).toFixed(2)} s`);
    if (finishReason && finishReason !== "stop") parts.push(`finish: ${finishReason}`);
    return parts.join(" · ");
  }

  async function send() {
    const text = els.prompt.value.trim();
    if (!text || controller) return;
    els.prompt.value = "";
    const userMessage = addUserMessage(text);
    const conversation = history; // "New chat" swaps in a fresh array; this reply stays with its own
    conversation.push({ role: "user", content: text });
    const reply = addAssistantMessage();
    scrollToEnd(true);
    setStreaming(true);
    setStatus("Generating…");
    controller = new AbortController();
    const started = performance.now();
    let firstToken = null;
    let finishReason = null;
    let usage = null;
    let state = "done";
    try {
      const response = await request("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(requestBody()),
        signal: controller.signal,
      });
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message ?? JSON.stringify(chunk.error));
        usage = chunk.usage ?? usage;
        for (const choice of chunk.choices ?? []) {
          const delta = choice.delta ?? {};
          if (delta.reasoning_content) reply.addReasoning(delta.reasoning_content);
          if (delta.content) reply.addAnswer(delta.content);
          if ((delta.reasoning_content || delta.content) && firstToken === null) firstToken = performance.now();
          finishReason = choice.finish_reason ?? finishReason;
        }
        scrollToEnd();
      }
    } catch (error) {
      if (error.name === "AbortError") {
        state = "stopped";
      } else {
        state = "error";
        if (!reply.answer) reply.article.remove();
        addError(error.message);
      }
    } finally {
      controller = null;
      setStreaming(false);
    }
    reply.article.dataset.state = state;
    reply.article.removeAttribute("aria-busy");
    if (reply.answer && state !== "error") {
      conversation.push({ role: "assistant", content: reply.answer });
    } else {
      conversation.pop(); // the user turn got no answer: leave it out of the next request
      userMessage.dataset.state = "failed";
    }
    const summary = describe(usage, finishReason, started, firstToken);
    reply.meta.textContent = state === "stopped" ? ["stopped", summary].filter(Boolean).join(" · ") : summary;
    setStatus(state === "stopped" ? "Stopped." : "");
  }

  function stop() {
    controller?.abort();
  }

  function newChat() {
    stop();
    history = [];
    els.messages.replaceChildren();
    setStatus("");
    els.prompt.focus();
  }

  els.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  els.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    } else if (event.key === "Escape") {
      stop();
    }
  });
  els.stop.addEventListener("click", stop);
  els.newChat.addEventListener("click", newChat);
  els.apiKey.value = sessionStorage.getItem(KEY_STORAGE) ?? "";
  if (els.apiKey.value) els.auth.hidden = false;
  els.apiKey.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, els.apiKey.value.trim());
    setStatus("");
    loadModel();
  });

  loadHealth();
  loadModel();
  els.prompt.focus();
})();
