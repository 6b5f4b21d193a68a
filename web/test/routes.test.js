import { test } from 'node:test';
import assert from 'node:assert/strict';
import { parseRoute, sessionHref } from '../src/routes.js';

test('client routes', () => {
  const id = '0b5e6c1e-7a52-4b7e-9a0c-1d2e3f405162';
  assert.deepEqual(parseRoute('/'), { name: 'home' });
  assert.deepEqual(parseRoute(sessionHref(id)), { name: 'session', id });
  assert.deepEqual(parseRoute(`/sessions/${id.toUpperCase()}/`), { name: 'session', id });
  assert.deepEqual(parseRoute('/sessions/nope'), { name: 'not_found' });
});
