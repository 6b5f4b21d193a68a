// The UI: sign-in, the session list, and one kept-alive workspace per root
// session (its conversation, member tabs, cooperation list and status).
import { h } from 'preact';
import { useState, useEffect, useRef, useCallback, useLayoutEffect } from 'preact/hooks';
import htm from 'htm';
import { api, newRequestId } from './api.js';
import { parseRoute, sessionHref } from './routes.js';
import { panelMode } from './layout.js';
import { hierarchy, summarize, queuedInputs, memberStatus, inFlight } from './state.js';
import { useAction, useRuntime, useWidth } from './hooks.js';
import { runtimeFor, stopAllRuntimes } from './runtime.js';

const html = htm.bind(h);
const PAGE_SIZE = 50;

function titleOf(s) {
  return s?.title || (s?.id ? `Session ${s.id.slice(0, 8)}` : 'Session');
}

function ErrorBox({ action, what }) {
  if (!action.error) return null;
  return html`<div class="error" role="alert">
    <span>${what} failed: ${action.error.message}</span>
    <button type="button" onClick=${() => action.retry()} disabled=${action.pending}>Retry</button>
  </div>`;
}

// ---------------------------------------------------------------- sign-in

export function App() {
  const [auth, setAuth] = useState('checking');
  useEffect(() => {
    api('GET', '/api/auth/session').then(() => setAuth('in'), () => setAuth('out'));
  }, []);
  if (auth === 'checking') return html`<p class="boot">Loading…</p>`;
  if (auth === 'out') return html`<${SignIn} onDone=${() => setAuth('in')} />`;
  return html`<${Shell} onSignedOut=${() => { stopAllRuntimes(); setAuth('out'); }} />`;
}

function SignIn({ onDone }) {
  const [key, setKey] = useState('');
  const action = useAction();
  const submit = async (e) => {
    e.preventDefault();
    const r = await action.run(() => api('POST', '/api/auth/session', { key }));
    if (r.ok) { setKey(''); onDone(); }
  };
  return html`<main class="signin">
    <h1>Yuxi sessions</h1>
    <form onSubmit=${submit}>
      <label for="api-key">API key</label>
      <input id="api-key" type="password" autocomplete="off" value=${key}
             onInput=${(e) => setKey(e.currentTarget.value)} required />
      <button type="submit" disabled=${action.pending}>Sign in</button>
    </form>
    ${action.error && html`<p class="error" role="alert">Sign-in failed: ${action.error.message}</p>`}
    <p class="hint">Use the key <code>make run</code> printed. It stays on the server: the page keeps only an HttpOnly sign-in cookie.</p>
  </main>`;
}

// ---------------------------------------------------------------- shell

function useRoute() {
  const [route, setRoute] = useState(() => parseRoute(location.pathname));
  useEffect(() => {
    const onPop = () => setRoute(parseRoute(location.pathname));
    addEventListener('popstate', onPop);
    return () => removeEventListener('popstate', onPop);
  }, []);
  const navigate = useCallback((href) => {
    if (location.pathname !== href) history.pushState(null, '', href);
    setRoute(parseRoute(href));
  }, []);
  return [route, navigate];
}

function Shell({ onSignedOut }) {
  const [route, navigate] = useRoute();
  const [listed, setListed] = useState([]);        // first pages of root sessions
  const [extra, setExtra] = useState({});          // roots loaded by id (not on a loaded page)
  const [cursor, setCursor] = useState(null);
  const [opened, setOpened] = useState([]);        // kept-alive workspaces (root ids)
  const [focus, setFocus] = useState({});          // root id -> member id to open
  const [unread, setUnread] = useState({});
  const [live, setLive] = useState({});            // root id -> status seen on its open stream
  const [creating, setCreating] = useState(false);
  const [missing, setMissing] = useState(null);
  const pages = useRef(1);
  const signOut = useAction();

  const refresh = useCallback(async () => {
    let items = [];
    let next = null;
    for (let i = 0; i < pages.current; i++) {
      const q = next ? `&cursor=${encodeURIComponent(next)}` : '';
      const page = await api('GET', `/api/sessions?limit=${PAGE_SIZE}${q}`);
      items = items.concat(page.items);
      next = page.next_cursor;
      if (!next) break;
    }
    setListed(items);
    setCursor(next);
  }, []);

  useEffect(() => {
    refresh().catch(() => {});
    const t = setInterval(() => refresh().catch(() => {}), 3000);
    return () => clearInterval(t);
  }, [refresh]);

  // Resolve the routed session: a root opens its workspace; a member opens
  // its tree's workspace with the member's tab; one missing from the loaded
  // pages is read by id.
  const activeId = route.name === 'session' ? route.id : null;
  const [activeRoot, setActiveRoot] = useState(null);
  useEffect(() => {
    if (!activeId) { setActiveRoot(null); return; }
    setMissing(null);
    setCreating(false);
    const known = listed.find((s) => s.id === activeId) || extra[activeId];
    const open = (rootId, memberId) => {
      setActiveRoot(rootId);
      setOpened((o) => (o.includes(rootId) ? o : [...o, rootId]));
      setUnread((u) => ({ ...u, [rootId]: false }));
      if (memberId) setFocus((f) => ({ ...f, [rootId]: { id: memberId, at: Date.now() } }));
    };
    if (known) { open(known.id); return; }
    let cancelled = false;
    (async () => {
      try {
        const s = await api('GET', `/api/sessions/${activeId}`);
        const root = s.parent_id ? await api('GET', `/api/sessions/${s.tree_id}`) : s;
        if (cancelled) return;
        setExtra((e) => ({ ...e, [root.id]: root }));
        open(root.id, s.parent_id ? s.id : null);
      } catch (e) {
        if (!cancelled) setMissing(e);
      }
    })();
    return () => { cancelled = true; };
  }, [activeId]);

  const roots = [...listed, ...Object.values(extra).filter((s) => !listed.some((l) => l.id === s.id))];
  const byId = Object.fromEntries(roots.map((s) => [s.id, s]));

  const markUnread = useCallback((rootId) => setUnread((u) => ({ ...u, [rootId]: true })), []);
  const reportStatus = useCallback((rootId, status) => setLive((l) => ({ ...l, [rootId]: status })), []);

  const more = async () => {
    pages.current += 1;
    await refresh();
  };

  const doSignOut = async () => {
    const r = await signOut.run(() => api('DELETE', '/api/auth/session'));
    if (r.ok) onSignedOut();
  };

  const link = (e, href) => {
    if (e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
    e.preventDefault();
    navigate(href);
  };

  return html`<div class="shell">
    <header class="topbar">
      <a class="brand" href="/" onClick=${(e) => link(e, '/')}>Yuxi sessions</a>
      <span class="spacer"></span>
      <button type="button" onClick=${() => setCreating(true)}>New session</button>
      <button type="button" onClick=${doSignOut} disabled=${signOut.pending}>Sign out</button>
    </header>
    <${ErrorBox} action=${signOut} what="Sign out" />
    <div class="frame">
      <nav aria-label="Sessions" class="sessions">
        <ul>
          ${roots.map((s) => {
            const status = live[s.id] || s.status;
            const running = status && status !== 'idle';
            return html`<li key=${s.id}>
              <a href=${sessionHref(s.id)} aria-current=${s.id === activeRoot ? 'page' : undefined}
                 onClick=${(e) => link(e, sessionHref(s.id))}>
                <span class="name">${titleOf(s)}</span>
                ${running && html`<span class="marker marker-running" title=${status}>${status.replace('_', ' ')}</span>`}
                ${unread[s.id] && html`<span class="marker marker-unread">unread</span>`}
              </a></li>`;
          })}
        </ul>
        ${cursor && html`<button type="button" class="more" onClick=${more}>More sessions</button>`}
        ${!roots.length && html`<p class="empty">No sessions yet.</p>`}
      </nav>
      <main class="stage">
        ${creating && html`<${NewSession} onCancel=${() => setCreating(false)}
            onCreated=${(s) => { setCreating(false); setExtra((e) => ({ ...e, [s.id]: s })); refresh().catch(() => {}); navigate(sessionHref(s.id)); }} />`}
        ${!creating && !activeRoot && !missing && html`<section class="welcome">
            <h1>Yuxi sessions</h1>
            <p>Pick a session on the left, or start one with <strong>New session</strong>.</p></section>`}
        ${missing && html`<p class="error" role="alert">Session not found: ${missing.message}</p>`}
        ${opened.map((rootId) => html`<${Workspace} key=${rootId} rootId=${rootId}
            session=${byId[rootId]} active=${!creating && rootId === activeRoot && !missing}
            focus=${focus[rootId]} onUnread=${markUnread} onStatus=${reportStatus} />`)}
      </main>
    </div>
  </div>`;
}

// ---------------------------------------------------------------- new session

function NewSession({ onCancel, onCreated }) {
  const [agents, setAgents] = useState([]);
  const [models, setModels] = useState([]);
  const [form, setForm] = useState({ agent: '', model: '', approval: 'auto', title: '' });
  const load = useAction();
  const create = useAction();
  useEffect(() => {
    load.run(async () => {
      const [a, m] = await Promise.all([api('GET', '/api/agents'), api('GET', '/api/models')]);
      setAgents(a);
      setModels(m.items || []);
      setForm((f) => ({ ...f, agent: f.agent || a[0]?.id || '' }));
    });
  }, []);
  const set = (k) => (e) => setForm((f) => ({ ...f, [k]: e.currentTarget.value }));
  const submit = async (e) => {
    e.preventDefault();
    const body = { agent_id: form.agent, approval_mode: form.approval };
    if (form.model) body.model = form.model;
    if (form.title.trim()) body.title = form.title.trim();
    const r = await create.run(() => api('POST', '/api/sessions', body));
    if (r.ok) onCreated(r.out);
  };
  return html`<section class="new-session" aria-label="New session">
    <h1>New session</h1>
    <form onSubmit=${submit}>
      <label for="ns-agent">Agent</label>
      <select id="ns-agent" value=${form.agent} onChange=${set('agent')} required>
        ${agents.map((a) => html`<option value=${a.id}>${a.name}</option>`)}
      </select>
      <label for="ns-model">Model</label>
      <select id="ns-model" value=${form.model} onChange=${set('model')}>
        <option value="">The agent's model</option>
        ${models.map((m) => html`<option value=${m.id}>${m.id}</option>`)}
      </select>
      <label for="ns-approval">Approval mode</label>
      <select id="ns-approval" value=${form.approval} onChange=${set('approval')}>
        <option value="auto">auto</option>
        <option value="confirm">confirm</option>
      </select>
      <label for="ns-title">Title</label>
      <input id="ns-title" value=${form.title} onInput=${set('title')} />
      <div class="row">
        <button type="submit" disabled=${create.pending || !form.agent}>Create</button>
        <button type="button" onClick=${onCancel}>Cancel</button>
      </div>
    </form>
    <${ErrorBox} action=${load} what="Loading agents and models" />
    <${ErrorBox} action=${create} what="Creating the session" />
  </section>`;
}

// ---------------------------------------------------------------- workspace

function Workspace({ rootId, session, active, focus, onUnread, onStatus }) {
  const rt = useRuntime(rootId);
  const tree = rt.tree;
  const root = tree.members[rootId];
  const [tabs, setTabs] = useState([]);          // 'coop' | member id
  const [selected, setSelected] = useState(null);
  const [maximized, setMaximized] = useState(false);
  const [panelOpen, setPanelOpen] = useState(false);
  const [areaWidth, setAreaWidth] = useState(0);
  const activeRef = useRef(active);
  activeRef.current = active;
  const entryRef = useRef(null);
  const panelRef = useRef(null);

  useEffect(() => rt.onLiveMessage(() => { if (!activeRef.current) onUnread(rootId); }), [rt]);

  const openTab = useCallback((key) => {
    setTabs((t) => (t.includes(key) ? t : [...t, key]));
    setSelected(key);
  }, []);
  const closeTab = (key) => {
    const rest = tabs.filter((k) => k !== key);
    setTabs(rest);
    if (selected === key) setSelected(rest[rest.length - 1] ?? (maximized ? rootId : null));
  };
  useEffect(() => { if (focus?.id) openTab(focus.id); }, [focus?.at]);

  const mode = panelMode({ sideMaximized: maximized, areaWidth });
  // A click outside closes only the floating panel, of the visible workspace.
  useEffect(() => {
    if (!panelOpen || mode !== 'floating' || !active) return undefined;
    const onDown = (e) => {
      if (entryRef.current?.contains(e.target) || panelRef.current?.contains(e.target)) return;
      setPanelOpen(false);
    };
    document.addEventListener('pointerdown', onDown, true);
    return () => document.removeEventListener('pointerdown', onDown, true);
  }, [panelOpen, mode, active]);

  const summary = summarize(tree);
  const rootStatus = root ? memberStatus(root) : null;
  useEffect(() => { if (rootStatus) onStatus(rootId, rootStatus); }, [rootStatus]);
  const panel = panelOpen && html`<${StatusPanel} panelRef=${panelRef} mode=${mode} summary=${summary}
      rootId=${rootId} onOpenList=${() => openTab('coop')} />`;
  const entry = html`<div class="status-entry" ref=${entryRef}>
    <button type="button" class="status-button" aria-label="Cooperation status" aria-expanded=${panelOpen ? 'true' : 'false'}
            onClick=${() => setPanelOpen((o) => !o)}>
      <span class="dot ${summary.stoppable ? 'busy' : ''}"></span>
      <span class="count">${summary.count}</span>
      <span class="sum">${summary.text}</span>
    </button>
    ${mode === 'floating' && panel}
  </div>`;

  const sideTabs = maximized ? [rootId, ...tabs] : tabs;
  const sideShown = sideTabs.length > 0;
  const current = sideTabs.includes(selected) ? selected : sideTabs[0];
  const label = (key) => (key === 'coop' ? 'Cooperation' : tree.members[key]?.path || 'Session');
  const rootTitle = titleOf({ ...session, title: root?.title ?? session?.title, id: rootId });

  return html`<section class="workspace ${maximized ? 'maximized' : ''}" hidden=${!active}
      aria-label=${`Workspace ${rootTitle}`} data-root=${rootId}>
    <div class="ws-bar">
      <h1 class="ws-title">${rootTitle}</h1>
      <span class="conn ${rt.connected ? 'on' : 'off'}">${rt.connected ? 'live' : 'reconnecting…'}</span>
      <span class="spacer"></span>
      ${maximized && entry}
      <button type="button" onClick=${() => { setMaximized((m) => !m); if (!maximized) setSelected(rootId); }}>
        ${maximized ? 'Restore' : 'Maximize'}</button>
    </div>
    <div class="ws-body ${sideShown ? 'split' : ''}">
      ${!maximized && html`<div class="main-col">
        <div class="main-head">${entry}</div>
        <${SessionView} rt=${rt} sessionId=${rootId} active=${active}
            onAreaWidth=${setAreaWidth} embedded=${mode === 'embedded' ? panel : null} />
      </div>`}
      ${sideShown && html`<div class="side">
        <div role="tablist" aria-label="Side tabs" class="tabs">
          ${sideTabs.map((key) => html`<div class="tab-wrap ${key === current ? 'on' : ''}" key=${key}>
            <button type="button" role="tab" id=${`tab-${rootId}-${key}`} aria-selected=${key === current ? 'true' : 'false'}
                    aria-controls=${`panel-${rootId}-${key}`} onClick=${() => setSelected(key)}>${label(key)}</button>
            ${!(maximized && key === rootId) && html`<button type="button" class="x" aria-label=${`Close ${label(key)}`}
                    onClick=${() => closeTab(key)}>×</button>`}
          </div>`)}
        </div>
        ${sideTabs.map((key) => html`<div role="tabpanel" key=${key} id=${`panel-${rootId}-${key}`}
              aria-labelledby=${`tab-${rootId}-${key}`} hidden=${key !== current} class="tabpanel">
          ${key === 'coop'
            ? html`<${CooperationList} rt=${rt} onOpen=${openTab} />`
            : html`<${SessionView} rt=${rt} sessionId=${key} active=${active && key === current} />`}
        </div>`)}
      </div>`}
    </div>
  </section>`;
}

function StatusPanel({ panelRef, mode, summary, rootId, onOpenList }) {
  const stop = useAction();
  return html`<section class="status-panel" data-mode=${mode} ref=${panelRef} aria-label="Cooperation status panel">
    <p class="count"><strong>${summary.count}</strong> cooperation session${summary.count === 1 ? '' : 's'}</p>
    <button type="button" class="summary" aria-label="Open cooperation list" onClick=${onOpenList}>${summary.text}</button>
    ${summary.stoppable && html`<button type="button" class="danger" disabled=${stop.pending}
        onClick=${() => stop.run(() => api('POST', `/api/sessions/${rootId}/stop`))}>Stop all</button>`}
    <${ErrorBox} action=${stop} what="Stop all" />
  </section>`;
}

function CooperationList({ rt, onOpen }) {
  const rows = hierarchy(rt.tree);
  return html`<div class="coop">
    <h2>Cooperation</h2>
    <ul class="tree">
      ${rows.map(({ member: m, depth }) => html`<li key=${m.id} style=${`--depth:${depth}`}>
        <button type="button" class="member" aria-label=${m.path} onClick=${() => onOpen(m.id === rt.rootId ? m.id : m.id)}>
          <span class="path">${m.path}</span>${m.title && m.title !== m.path && html` <span class="title">${m.title}</span>`}
        </button>
        <span class="state state-${memberStatus(m)}">${memberStatus(m).replace('_', ' ')}</span>
        ${m.paused && html`<${ContinueQueue} sessionId=${m.id} />`}
      </li>`)}
    </ul>
  </div>`;
}

function ContinueQueue({ sessionId }) {
  const action = useAction();
  return html`<span class="continue">
    <button type="button" disabled=${action.pending}
      onClick=${() => action.run(() => api('POST', `/api/sessions/${sessionId}/queue/continue`))}>Continue queue</button>
    <${ErrorBox} action=${action} what="Continue queue" />
  </span>`;
}

// ---------------------------------------------------------------- one session

function SessionView({ rt, sessionId, active, onAreaWidth, embedded }) {
  const m = rt.tree.members[sessionId];
  const wrapRef = useRef(null);
  const logRef = useRef(null);
  const scroll = useRef({ top: 0, atBottom: true });
  const width = useWidth(wrapRef);
  useEffect(() => { if (onAreaWidth && width) onAreaWidth(width); }, [width]);

  const items = m?.items || [];
  const lastItem = items[items.length - 1];
  useLayoutEffect(() => {
    const el = logRef.current;
    if (el && active && scroll.current.atBottom) el.scrollTop = el.scrollHeight;
  }, [items.length, lastItem?.content, lastItem?.done]);
  useLayoutEffect(() => {
    const el = logRef.current;
    if (el && active) el.scrollTop = scroll.current.atBottom ? el.scrollHeight : scroll.current.top;
  }, [active]);
  const onScroll = (e) => {
    const el = e.currentTarget;
    if (!active || el.clientHeight === 0) return;
    scroll.current = { top: el.scrollTop, atBottom: el.scrollHeight - el.scrollTop - el.clientHeight < 24 };
  };

  if (!m || !m.path) return html`<div class="session-view loading">Loading…</div>`;
  return html`<div class="session-view" data-session=${sessionId}>
    <div class="log-wrap" ref=${wrapRef}>
      <div class="log" role="log" aria-label="Conversation" ref=${logRef} onScroll=${onScroll} tabindex="0">
        <div class="col">
          ${items.length === 0 && html`<p class="empty">No messages yet. Say something below.</p>`}
          ${items.map((item) => html`<${Item} key=${item.key} item=${item} />`)}
        </div>
      </div>
      ${embedded && html`<div class="embedded-slot">${embedded}</div>`}
    </div>
    ${m.pending?.kind === 'approval' && html`<${ApprovalCard} key=${m.pending.waitId} pending=${m.pending} />`}
    ${m.pending?.kind === 'questions' && html`<${QuestionCard} key=${m.pending.waitId} pending=${m.pending} />`}
    <${Queue} m=${m} />
    <${Composer} rt=${rt} m=${m} />
  </div>`;
}

function Item({ item }) {
  if (item.kind === 'user') {
    return html`<div class="msg user">
      <div class="who">You${item.steer ? ' · steer' : item.mode === 'queue' ? ' · queued' : ''}</div>
      <div class="text">${item.content ?? '…'}</div></div>`;
  }
  if (item.kind === 'assistant') {
    const calls = item.toolCalls?.length ? item.toolCalls.map((c) => c.name).join(', ') : '';
    if (!item.content && calls) return html`<div class="msg assistant calls"><div class="who">Assistant</div><div class="text muted">Calling ${calls}</div></div>`;
    return html`<div class="msg assistant ${item.streaming ? 'streaming' : ''}" data-message=${item.messageId}>
      <div class="who">Assistant</div><div class="text">${item.content}</div></div>`;
  }
  if (item.kind === 'tool') {
    return html`<details class="tool ${item.done ? 'done' : 'running'}">
      <summary><span class="tool-name">${item.tool}</span> ${item.done ? 'finished' : 'running…'}</summary>
      <div class="tool-body">
        ${item.args !== undefined && html`<div class="label">Arguments</div><pre>${JSON.stringify(item.args, null, 2)}</pre>`}
        ${item.done && html`<div class="label">Result</div><pre>${pretty(item.result)}</pre>`}
      </div>
    </details>`;
  }
  return html`<p class="notice ${item.tone || ''}">${item.text}</p>`;
}

function pretty(result) {
  if (typeof result !== 'string') return JSON.stringify(result, null, 2);
  try { return JSON.stringify(JSON.parse(result), null, 2); } catch { return result; }
}

function Queue({ m }) {
  const queued = queuedInputs(m);
  return html`${m.paused && html`<div class="banner paused" role="status">
      <span>Queue paused${queued.length ? ` (${queued.length} waiting)` : ''}.</span>
      <${ContinueQueue} sessionId=${m.id} /></div>`}
    ${queued.length > 0 && html`<section class="queued" aria-label="Queued inputs">
      <ol>${queued.map((q) => html`<li key=${q.id}><span class="pos">#${q.position}</span> ${q.content ?? '…'}</li>`)}</ol>
    </section>`}`;
}

function Composer({ rt, m }) {
  const [draft, setDraft] = useState('');
  const [mode, setMode] = useState('steer');
  const send = useAction();
  const cancel = useAction();
  const name = useRef(`mode-${Math.random().toString(36).slice(2)}`).current;
  const submit = async (e) => {
    e.preventDefault();
    const content = draft;
    if (!content.trim()) return;
    const body = { content, mode, client_request_id: newRequestId() };
    const r = await send.run(async () => {
      const receipt = await api('POST', `/api/sessions/${m.id}/inputs`, body);
      rt.knowInput(m.id, receipt.input_id, content);
      setDraft((d) => (d === content ? '' : d));
      return receipt;
    });
    return r;
  };
  const turn = inFlight(m) ? m.currentTurn : null;
  return html`<form class="composer" onSubmit=${submit}>
    <${ErrorBox} action=${send} what="Sending" />
    <${ErrorBox} action=${cancel} what="Cancel turn" />
    <label class="sr" for=${`${name}-msg`}>Message</label>
    <textarea id=${`${name}-msg`} rows="2" placeholder="Message" value=${draft}
      onInput=${(e) => setDraft(e.currentTarget.value)}
      onKeyDown=${(e) => { if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) submit(e); }}></textarea>
    <div class="controls">
      <fieldset class="modes"><legend class="sr">Input mode</legend>
        <label><input type="radio" name=${name} value="steer" checked=${mode === 'steer'} onChange=${() => setMode('steer')} /> Steer</label>
        <label><input type="radio" name=${name} value="queue" checked=${mode === 'queue'} onChange=${() => setMode('queue')} /> Queue</label>
      </fieldset>
      <span class="spacer"></span>
      ${turn && html`<button type="button" class="danger" disabled=${cancel.pending}
          onClick=${() => cancel.run(() => api('POST', `/api/turns/${turn}/cancel`))}>Cancel turn</button>`}
      <button type="submit" disabled=${send.pending || !draft.trim()}>Send</button>
    </div>
  </form>`;
}

// ---------------------------------------------------------------- waiting for the user

function ApprovalCard({ pending }) {
  const [decisions, setDecisions] = useState({});
  const action = useAction();
  const approvals = pending.approvals || [];
  const submitWith = (next) => {
    if (approvals.every((a) => a.call_id in next)) {
      const body = { decisions: approvals.map((a) => ({ call_id: a.call_id, approve: next[a.call_id] })) };
      action.run(() => api('POST', `/api/turns/${pending.turnId}/answer`, body));
    }
  };
  const decide = (callId, approve) => {
    const next = { ...decisions, [callId]: approve };
    setDecisions(next);
    submitWith(next);
  };
  return html`<section class="card approval" aria-label="Approval needed">
    <h3>Approval needed</h3>
    ${approvals.map((a) => html`<div class="call" key=${a.call_id}>
      <div><code>${a.tool}</code></div>
      <pre>${JSON.stringify(a.args, null, 2)}</pre>
      <div class="row">
        <button type="button" aria-pressed=${decisions[a.call_id] === true ? 'true' : 'false'} disabled=${action.pending}
          onClick=${() => decide(a.call_id, true)}>Approve</button>
        <button type="button" aria-pressed=${decisions[a.call_id] === false ? 'true' : 'false'} disabled=${action.pending}
          onClick=${() => decide(a.call_id, false)}>Reject</button>
      </div>
    </div>`)}
    ${action.pending && html`<p class="muted" role="status">Sending your decision…</p>`}
    <${ErrorBox} action=${action} what="Sending the decision" />
  </section>`;
}

function QuestionCard({ pending }) {
  const questions = pending.questions || [];
  const [picked, setPicked] = useState({});      // id -> [values]
  const [other, setOther] = useState({});        // id -> text
  const action = useAction();
  const toggle = (q, value, on) => setPicked((p) => {
    const cur = p[q.id] || [];
    const next = q.multi_select ? (on ? [...cur.filter((v) => v !== value), value] : cur.filter((v) => v !== value)) : [value];
    return { ...p, [q.id]: next };
  });
  const submit = (e) => {
    e.preventDefault();
    const answers = {};
    for (const q of questions) {
      const values = (picked[q.id] || []).map((v) => (v === '\u0000other' ? (other[q.id] || '').trim() : v))
        .filter((v) => v);
      if (!q.options.length) values.push(...[(other[q.id] || '').trim()].filter(Boolean));
      answers[q.id] = q.multi_select ? values : (values[0] ?? '');
    }
    action.run(() => api('POST', `/api/turns/${pending.turnId}/answer`, { answers }));
  };
  return html`<form class="card questions" aria-label="Questions" onSubmit=${submit}>
    <h3>Questions</h3>
    ${questions.map((q) => {
      const type = q.multi_select ? 'checkbox' : 'radio';
      const name = `q-${pending.waitId}-${q.id}`;
      const has = (v) => (picked[q.id] || []).includes(v);
      return html`<fieldset key=${q.id}><legend>${q.question}</legend>
        ${q.options.map((o) => html`<label class="opt"><input type=${type} name=${name} value=${o} checked=${has(o)}
            onChange=${(e) => toggle(q, o, e.currentTarget.checked)} /> ${o}</label>`)}
        ${q.options.length > 0 && q.allow_other && html`<label class="opt"><input type=${type} name=${name} value="other"
            checked=${has('\u0000other')} onChange=${(e) => toggle(q, '\u0000other', e.currentTarget.checked)} /> Other</label>`}
        ${(q.allow_other || !q.options.length) && html`<input type="text" aria-label=${q.options.length ? 'Other answer' : 'Answer'}
            value=${other[q.id] || ''} onInput=${(e) => { const v = e.currentTarget.value; setOther((o) => ({ ...o, [q.id]: v })); if (q.options.length && v && !has('\u0000other')) toggle(q, '\u0000other', true); }} />`}
      </fieldset>`;
    })}
    <div class="row"><button type="submit" disabled=${action.pending}>Submit answers</button>
      ${action.pending && html`<span class="muted" role="status">Sending your answers…</span>`}</div>
    <${ErrorBox} action=${action} what="Sending the answers" />
  </form>`;
}

export { runtimeFor };
