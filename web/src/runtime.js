// One observation per tree (shared by every view of that tree): the tree's
// SSE stream (`?scope=tree`), folded into the state of state.js. The browser's
// EventSource reconnects by itself with Last-Event-ID; when it gives up
// (an HTTP error), we open a new one with `?after=<last seq>`. applyEvent
// drops what was already seen, so nothing is shown twice.
import { api } from './api.js';
import { emptyTree, applyEvent, setInputContent } from './state.js';

const runtimes = new Map();

export function runtimeFor(rootId) {
  let rt = runtimes.get(rootId);
  if (!rt) {
    rt = new TreeRuntime(rootId);
    runtimes.set(rootId, rt);
    rt.start();
  }
  return rt;
}

export function stopAllRuntimes() {
  for (const rt of runtimes.values()) rt.stop();
  runtimes.clear();
}

class TreeRuntime {
  constructor(rootId) {
    this.rootId = rootId;
    this.tree = emptyTree(rootId);
    this.listeners = new Set();
    this.messageListeners = new Set();
    this.connected = false;
    this.openedAt = Date.now();
    this.es = null;
    this.timer = null;
    this.fetching = new Set();
    this.stopped = false;
  }

  subscribe(fn) { this.listeners.add(fn); return () => this.listeners.delete(fn); }
  onLiveMessage(fn) { this.messageListeners.add(fn); return () => this.messageListeners.delete(fn); }
  notify() { for (const fn of this.listeners) fn(this.tree.version); }

  start() {
    if (this.stopped) return;
    const after = this.tree.lastSeq ? `&after=${this.tree.lastSeq}` : '';
    const es = new EventSource(`/api/sessions/${this.rootId}/events?scope=tree${after}`);
    this.es = es;
    es.onopen = () => { this.connected = true; this.tree.version++; this.notify(); };
    es.onmessage = (e) => {
      let ev;
      try { ev = JSON.parse(e.data); } catch { return; }
      if (!applyEvent(this.tree, ev)) return;
      if (ev.type === 'input.received') this.loadInput(ev.session_id, ev.data.input_id);
      if (ev.type === 'message' && Date.parse(ev.created_at) >= this.openedAt) {
        for (const fn of this.messageListeners) fn(ev);
      }
      this.notify();
    };
    es.onerror = () => {
      this.connected = false;
      this.tree.version++;
      this.notify();
      if (es.readyState === EventSource.CLOSED) {
        clearTimeout(this.timer);
        this.timer = setTimeout(() => { if (this.es === es) this.start(); }, 1500);
      }
    };
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    this.es?.close();
  }

  /** An input's text: known from our own receipt, else read once by id. */
  knowInput(sessionId, inputId, content) {
    setInputContent(this.tree, sessionId, inputId, content);
    this.notify();
  }

  async loadInput(sessionId, inputId) {
    const m = this.tree.members[sessionId];
    if (m?.inputs[inputId]?.content != null || this.fetching.has(inputId)) return;
    this.fetching.add(inputId);
    try {
      const input = await api('GET', `/api/inputs/${inputId}`);
      setInputContent(this.tree, sessionId, inputId, input.content);
      this.notify();
    } catch {
      this.fetching.delete(inputId);   // another event or a later view retries
    }
  }
}
