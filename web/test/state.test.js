import { test } from 'node:test';
import assert from 'node:assert/strict';
import { emptyTree, applyEvent, queuedInputs, memberStatus, summarize, hierarchy,
         setInputContent, inFlight } from '../src/state.js';

const ROOT = 'r';
let seq = 0;
const ev = (type, data = {}, extra = {}) => ({ seq: ++seq, type, session_id: ROOT, turn_id: null, data, ...extra });

function tree() {
  seq = 0;
  const t = emptyTree(ROOT);
  applyEvent(t, ev('session.created', { path: '/root', title: 'first' }));
  return t;
}

test('a replayed or repeated event is applied once', () => {
  const t = tree();
  const e = ev('message', { message_id: 'm1', role: 'ai', content: 'hi', tool_calls: [] });
  assert.equal(applyEvent(t, e), true);
  assert.equal(applyEvent(t, e), false);
  assert.equal(applyEvent(t, { ...e, seq: 1 }), false);
  assert.equal(t.members[ROOT].items.filter((i) => i.kind === 'assistant').length, 1);
});

test('deltas stream into one message that the durable message replaces', () => {
  const t = tree();
  const delta = (text) => ({ type: 'message.delta', session_id: ROOT, turn_id: 't', run_id: 'x',
                             data: { message_id: 'm1', delta: text } });
  applyEvent(t, delta('Hel'));
  applyEvent(t, delta('lo'));
  let items = t.members[ROOT].items;
  assert.equal(items.length, 1);
  assert.equal(items[0].content, 'Hello');
  assert.equal(items[0].streaming, true);
  applyEvent(t, ev('message', { message_id: 'm1', role: 'ai', content: 'Hello world' }));
  items = t.members[ROOT].items;
  assert.equal(items.length, 1);
  assert.deepEqual([items[0].content, items[0].streaming], ['Hello world', false]);
  assert.equal(applyEvent(t, delta(' late')), false, 'a late delta never changes the durable text');
  assert.equal(t.members[ROOT].items[0].content, 'Hello world');
});

test('queued inputs keep FIFO positions until their turn starts', () => {
  const t = tree();
  applyEvent(t, ev('input.received', { input_id: 'i1', mode: 'steer', steer: false }, { turn_id: 't1' }));
  applyEvent(t, ev('turn.started', { input_id: 'i1' }, { turn_id: 't1' }));
  applyEvent(t, ev('input.received', { input_id: 'i2', mode: 'queue', steer: false }, { turn_id: 't2' }));
  applyEvent(t, ev('input.received', { input_id: 'i3', mode: 'queue', steer: false }, { turn_id: 't3' }));
  applyEvent(t, ev('input.received', { input_id: 'i4', mode: 'steer', steer: true }, { turn_id: 't1' }));
  const m = t.members[ROOT];
  assert.deepEqual(queuedInputs(m).map((i) => [i.id, i.position]), [['i2', 1], ['i3', 2]]);
  assert.equal(memberStatus(m), 'running');
  applyEvent(t, ev('turn.completed', { input_id: 'i1' }, { turn_id: 't1' }));
  applyEvent(t, ev('turn.started', { input_id: 'i2' }, { turn_id: 't2' }));
  assert.deepEqual(queuedInputs(m).map((i) => [i.id, i.position]), [['i3', 1]]);
  setInputContent(t, ROOT, 'i3', 'third');
  assert.equal(m.items.find((i) => i.inputId === 'i3').content, 'third');
});

test('an input whose text is known from the receipt first still queues', () => {
  const t = tree();
  applyEvent(t, ev('input.received', { input_id: 'i1', mode: 'steer', steer: false }, { turn_id: 't1' }));
  applyEvent(t, ev('turn.started', { input_id: 'i1' }, { turn_id: 't1' }));
  setInputContent(t, ROOT, 'i2', 'mine');       // the receipt came before the event
  applyEvent(t, ev('input.received', { input_id: 'i2', mode: 'queue', steer: false }, { turn_id: 't2' }));
  assert.deepEqual(queuedInputs(t.members[ROOT]).map((i) => [i.content, i.position]), [['mine', 1]]);
});

test('a pending request shows until answered; pause and continue', () => {
  const t = tree();
  applyEvent(t, ev('input.received', { input_id: 'i1', mode: 'steer', steer: false }, { turn_id: 't1' }));
  applyEvent(t, ev('turn.started', { input_id: 'i1' }, { turn_id: 't1' }));
  applyEvent(t, ev('turn.waiting_user', { wait_id: 'w', pending: { kind: 'approval', approvals: [{ call_id: 'c', tool: 'add_note', args: {} }] } }, { turn_id: 't1' }));
  const m = t.members[ROOT];
  assert.equal(memberStatus(m), 'waiting_user');
  assert.equal(m.pending.approvals[0].call_id, 'c');
  assert.equal(summarize(t).attention.waiting_user, 1);
  applyEvent(t, ev('turn.answered', { wait_id: 'w' }, { turn_id: 't1' }));
  assert.equal(m.pending, null);
  assert.equal(memberStatus(m), 'running');
  applyEvent(t, ev('queue.paused', { reason: 'cancel' }));
  assert.equal(m.paused, true);
  applyEvent(t, ev('queue.continued'));
  assert.equal(m.paused, false);
});

test('hierarchy and summary of a tree', () => {
  const t = tree();
  const child = (id, path, parent) => applyEvent(t, ev('session.created', { path, title: path, parent_id: parent }, { session_id: id }));
  child('w', '/root/writer', ROOT);
  child('v', '/root/reviewer', ROOT);
  child('d', '/root/writer/drafter', 'w');
  assert.deepEqual(hierarchy(t).map((h) => [h.member.path, h.depth]),
                   [['/root', 0], ['/root/writer', 1], ['/root/writer/drafter', 2], ['/root/reviewer', 1]]);
  let s = summarize(t);
  assert.equal(s.count, 4);
  assert.equal(s.stoppable, false);
  assert.equal(s.text, 'nothing needs attention');
  applyEvent(t, ev('input.received', { input_id: 'x', mode: 'steer', steer: false }, { session_id: 'w', turn_id: 'tw' }));
  applyEvent(t, ev('turn.started', { input_id: 'x' }, { session_id: 'w', turn_id: 'tw' }));
  s = summarize(t);
  assert.equal(s.stoppable, true);
  assert.equal(inFlight(t.members.w), true);
  applyEvent(t, ev('turn.failed', { input_id: 'x', error: 'boom' }, { session_id: 'w', turn_id: 'tw' }));
  s = summarize(t);
  assert.equal(s.stoppable, false);
  assert.equal(s.attention.failed, 1);
  assert.match(s.text, /1 failed/);
});

test('a queued input on a paused queue needs attention, not Stop all', () => {
  const t = tree();
  applyEvent(t, ev('queue.paused', { reason: 'stop' }));
  applyEvent(t, ev('input.received', { input_id: 'q', mode: 'queue', steer: false }, { turn_id: 'tq' }));
  const s = summarize(t);
  assert.equal(s.stoppable, false);
  assert.equal(s.attention.paused, 1);
});
