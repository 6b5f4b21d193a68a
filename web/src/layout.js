// Where the cooperation status panel goes: embedded in the right margin of
// the message area, or floating under the status button.
//
// Embedded only when the side area is not maximized and the margin beside
// the centred message column holds the whole panel with a gap on both sides;
// otherwise it floats (and a click outside closes it).

export const PANEL_WIDTH = 280;
export const CONTENT_MAX = 720;
export const GAP = 16;

/** The width of the message column in a message area `areaWidth` wide. */
export function contentWidth(areaWidth, { contentMax = CONTENT_MAX, gap = GAP } = {}) {
  return Math.max(0, Math.min(contentMax, areaWidth - 2 * gap));
}

/** 'embedded' | 'floating' */
export function panelMode({ sideMaximized = false, areaWidth = 0, panelWidth = PANEL_WIDTH,
                            contentMax = CONTENT_MAX, gap = GAP } = {}) {
  if (sideMaximized || !(areaWidth > 0)) return 'floating';
  const margin = (areaWidth - contentWidth(areaWidth, { contentMax, gap })) / 2;
  return margin >= panelWidth + 2 * gap ? 'embedded' : 'floating';
}
