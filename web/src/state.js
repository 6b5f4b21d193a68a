// The observation of one tree, built from its SSE events only (the stream
// replays from the table, so the whole state is derived from events):
// members (path, title, parent), per member the conversation items, the
// inputs and their queue, the turn in flight, a pending user request and
// the queue's pause. `applyEvent` is the only writer; it drops events it has
// already seen (by `seq`), so a reconnect never duplicates anything, and it
// renders `message.delta` frames (no seq) live until the durable `message`
// with the same message_id replaces them.

const IN_FLIGHT = new Set(['queued', 'running', 'waiting', 'waiting_user', 'cancelling']);

export function emptyTree(rootId) {
  return { rootId, lastSeq: 0, version: 0, members: {}, order: [] };
}

export function member(tree, id) {
  let m = tree.members[id];
  if (!m) {
    m = tree.members[id] = {
      id, path: null, title: null, parentId: null,
      items: [], index: {},            // conversation items, keyed
      inputs: {}, inputOrder: [],      // input_id -> {mode, steer, turnId, state, seq, content}
      turns: {},                       // turn_id -> status
      currentTurn: null,               // the turn in flight (started, not ended)
      pending: null,                   // {turnId, waitId, kind, approvals?, questions?}
      paused: false, lastError: null, lastTurnStatus: null,
    };
    tree.order.push(id);
  }
  return m;
}

function put(m, item) {
  const at = m.index[item.key];
  if (at === undefined) {
    m.index[item.key] = m.items.length;
    m.items.push(item);
  } else {
    m.items[at] = { ...m.items[at], ...item };
  }
}

function endTurn(m, turnId, status, error) {
  if (turnId) m.turns[turnId] = status;
  if (m.currentTurn === turnId) m.currentTurn = null;
  if (m.pending && m.pending.turnId === turnId) m.pending = null;
  m.lastTurnStatus = status;
  m.lastError = status === 'failed' ? (error || 'failed') : null;
  for (const id of m.inputOrder) {
    const input = m.inputs[id];
    if (input.turnId === turnId && input.state !== 'ended') input.state = 'ended';
  }
}

/** Apply one SSE payload; returns true when the tree changed. */
export function applyEvent(tree, ev) {
  if (!ev || typeof ev !== 'object' || !ev.type) return false;
  if (ev.type === 'message.delta') return applyDelta(tree, ev);
  if (typeof ev.seq === 'number') {
    if (ev.seq <= tree.lastSeq) return false;      // already seen: no duplicate
    tree.lastSeq = ev.seq;
  }
  const d = ev.data || {};
  const m = member(tree, ev.session_id);
  const turnId = ev.turn_id;
  switch (ev.type) {
    case 'session.created':
      m.path = d.path ?? m.path;
      m.title = d.title ?? m.title;
      m.parentId = d.parent_id ?? null;
      break;
    case 'session.updated':
      if ('title' in d) m.title = d.title;
      break;
    case 'input.received': {
      const known = m.inputs[d.input_id];
      m.inputs[d.input_id] = { content: null, ...known, id: d.input_id, mode: d.mode,
                               steer: !!d.steer, turnId, seq: ev.seq,
                               state: d.steer ? 'steer' : 'queued' };
      if (!m.inputOrder.includes(d.input_id)) m.inputOrder.push(d.input_id);
      put(m, { key: `input:${d.input_id}`, kind: 'user', inputId: d.input_id, mode: d.mode,
               steer: !!d.steer, content: m.inputs[d.input_id].content });
      break;
    }
    case 'turn.started': {
      const input = m.inputs[d.input_id];
      if (input) input.state = 'started';
      m.currentTurn = turnId;
      m.turns[turnId] = 'running';
      break;
    }
    case 'turn.waiting':
      m.turns[turnId] = 'waiting';
      break;
    case 'turn.resumed':
    case 'turn.answered':
      m.turns[turnId] = 'running';
      if (m.pending && m.pending.turnId === turnId) m.pending = null;
      break;
    case 'turn.waiting_user':
      m.turns[turnId] = 'waiting_user';
      m.pending = { turnId, waitId: d.wait_id, ...(d.pending || {}) };
      break;
    case 'turn.cancelling':
      m.turns[turnId] = 'cancelling';
      if (m.pending && m.pending.turnId === turnId) m.pending = null;
      break;
    case 'turn.completed':
      endTurn(m, turnId, 'completed');
      break;
    case 'turn.failed':
      endTurn(m, turnId, 'failed', d.error);
      put(m, { key: `seq:${ev.seq}`, kind: 'notice', tone: 'error', text: `Turn failed: ${d.error || 'error'}` });
      break;
    case 'turn.cancelled':
      endTurn(m, turnId, 'cancelled');
      put(m, { key: `seq:${ev.seq}`, kind: 'notice', tone: 'muted', text: 'Turn cancelled' });
      break;
    case 'message': {
      if (d.role && d.role !== 'ai' && d.role !== 'assistant') break;
      put(m, { key: `msg:${d.message_id}`, kind: 'assistant', messageId: d.message_id,
               content: textOf(d.content), toolCalls: d.tool_calls || [], streaming: false });
      break;
    }
    case 'tool.started':
      put(m, { key: `call:${d.call_id}`, kind: 'tool', callId: d.call_id, tool: d.tool,
               args: d.args, result: null, done: false });
      break;
    case 'tool.finished':
      put(m, { key: `call:${d.call_id}`, kind: 'tool', callId: d.call_id, tool: d.tool,
               result: d.result, done: true });
      break;
    case 'queue.paused':
      m.paused = true;
      break;
    case 'queue.continued':
      m.paused = false;
      break;
    default:
      break;
  }
  tree.version++;
  return true;
}

function applyDelta(tree, ev) {
  const d = ev.data || {};
  if (!d.message_id || typeof d.delta !== 'string') return false;
  const m = member(tree, ev.session_id);
  const key = `msg:${d.message_id}`;
  const at = m.index[key];
  if (at !== undefined && !m.items[at].streaming) return false;   // durable text already here
  const before = at === undefined ? '' : m.items[at].content;
  put(m, { key, kind: 'assistant', messageId: d.message_id, content: before + d.delta,
           toolCalls: [], streaming: true });
  tree.version++;
  return true;
}

export function textOf(content) {
  if (typeof content === 'string') return content;
  if (Array.isArray(content)) return content.map((p) => (typeof p === 'string' ? p : p?.text ?? '')).join('');
  return content == null ? '' : JSON.stringify(content);
}

/** Record an input's text (from the receipt or GET /api/inputs/{id}). */
export function setInputContent(tree, sessionId, inputId, content) {
  const m = member(tree, sessionId);
  m.inputs[inputId] = { ...(m.inputs[inputId] || { id: inputId }), content };
  if (m.index[`input:${inputId}`] !== undefined) put(m, { key: `input:${inputId}`, content });
  tree.version++;
}

/** Inputs waiting in the session's FIFO, with their 1-based positions. */
export function queuedInputs(m) {
  return m.inputOrder.map((id) => m.inputs[id]).filter((i) => i.state === 'queued')
    .map((input, i) => ({ ...input, position: i + 1 }));
}

/** idle | running | waiting | waiting_user | cancelling (derived). */
export function memberStatus(m) {
  if (m.pending) return 'waiting_user';
  if (!m.currentTurn) return 'idle';
  const s = m.turns[m.currentTurn];
  return s === 'waiting' || s === 'waiting_user' || s === 'cancelling' ? s : 'running';
}

export function inFlight(m) {
  return !!m.currentTurn && IN_FLIGHT.has(m.turns[m.currentTurn] || 'running');
}

/** Members in tree order (depth first, by creation), with their depth. */
export function hierarchy(tree) {
  const children = {};
  const roots = [];
  for (const id of tree.order) {
    const m = tree.members[id];
    if (!m.path) continue;
    if (m.parentId && tree.members[m.parentId]) (children[m.parentId] ||= []).push(m);
    else roots.push(m);
  }
  const out = [];
  const walk = (m, depth) => {
    out.push({ member: m, depth });
    for (const c of children[m.id] || []) walk(c, depth + 1);
  };
  roots.forEach((r) => walk(r, 0));
  return out;
}

/** The status entry's summary: members, what needs attention, Stop all. */
export function summarize(tree) {
  const members = hierarchy(tree).map((h) => h.member);
  const attention = { waiting_user: 0, failed: 0, paused: 0 };
  let running = 0;
  let stoppable = false;
  for (const m of members) {
    const status = memberStatus(m);
    if (status === 'waiting_user') attention.waiting_user++;
    if (m.lastTurnStatus === 'failed' && !m.currentTurn) attention.failed++;
    if (m.paused && queuedInputs(m).length) attention.paused++;
    if (status !== 'idle') running++;
    if (inFlight(m) || (!m.paused && queuedInputs(m).length > 0)) stoppable = true;
  }
  const parts = [];
  if (attention.waiting_user) parts.push(`${attention.waiting_user} waiting for you`);
  if (attention.failed) parts.push(`${attention.failed} failed`);
  if (attention.paused) parts.push(`${attention.paused} queue paused`);
  if (running) parts.push(`${running} active`);
  return { count: members.length, attention, running, stoppable,
           text: parts.length ? parts.join(', ') : 'nothing needs attention' };
}
