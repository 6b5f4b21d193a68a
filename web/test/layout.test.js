import { test } from 'node:test';
import assert from 'node:assert/strict';
import { panelMode, contentWidth, PANEL_WIDTH, CONTENT_MAX, GAP } from '../src/layout.js';

// The cases every implementation of the decision must pass. `failures(impl)`
// lists the cases an implementation gets wrong, so the negative case (an
// implementation that always floats) is checked to fail the embedded ones.
const CASES = [
  { name: 'wide message area embeds', args: { areaWidth: 1940 }, want: 'embedded' },
  { name: 'just wide enough embeds',
    args: { areaWidth: CONTENT_MAX + 2 * (PANEL_WIDTH + 2 * GAP) }, want: 'embedded' },
  { name: 'one pixel less floats',
    args: { areaWidth: CONTENT_MAX + 2 * (PANEL_WIDTH + 2 * GAP) - 1 }, want: 'floating' },
  { name: '1280 px window with the side list floats', args: { areaWidth: 1020 }, want: 'floating' },
  { name: 'narrow phone floats', args: { areaWidth: 375 }, want: 'floating' },
  { name: 'maximized side area always floats', args: { areaWidth: 3000, sideMaximized: true }, want: 'floating' },
  { name: 'unmeasured area floats', args: { areaWidth: 0 }, want: 'floating' },
];

function failures(impl) {
  return CASES.filter((c) => impl(c.args) !== c.want).map((c) => c.name);
}

test('panelMode decides embedded versus floating', () => {
  assert.deepEqual(failures(panelMode), []);
});

test('negative: an always-floating implementation fails the embedded cases', () => {
  assert.deepEqual(failures(() => 'floating'),
                   ['wide message area embeds', 'just wide enough embeds']);
});

test('negative: an always-embedded implementation fails the floating cases', () => {
  assert.equal(failures(() => 'embedded').length, 5);
});

test('contentWidth keeps gaps on a narrow area and caps the column', () => {
  assert.equal(contentWidth(375), 375 - 2 * GAP);
  assert.equal(contentWidth(5000), CONTENT_MAX);
  assert.equal(contentWidth(10), 0);
});
