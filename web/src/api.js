// The UI's HTTP client: same origin, the HttpOnly sign-in cookie goes by
// itself; every state-changing request repeats the readable `yuxi_csrf`
// cookie in the X-Yuxi-CSRF header (double submit). Errors carry the API's
// `{code, message, errors}` body.

export class ApiError extends Error {
  constructor(status, body) {
    super((body && body.message) || (status ? `HTTP ${status}` : 'network error'));
    this.status = status;
    this.code = (body && body.code) || (status ? 'http_error' : 'network_error');
    this.errors = (body && body.errors) || [];
  }
}

export function csrfToken(cookie = globalThis.document?.cookie || '') {
  const m = /(?:^|;\s*)yuxi_csrf=([^;]*)/.exec(cookie);
  return m ? decodeURIComponent(m[1]) : '';
}

export async function api(method, path, body) {
  const headers = { Accept: 'application/json' };
  if (method !== 'GET' && method !== 'HEAD') headers['X-Yuxi-CSRF'] = csrfToken() || 'sign-in';
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let response;
  try {
    response = await fetch(path, { method, headers, credentials: 'same-origin',
                                   body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {
    throw new ApiError(0, { message: `network error: ${e.message}` });
  }
  let data = null;
  try { data = await response.json(); } catch { data = null; }
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

export function newRequestId() {
  return globalThis.crypto?.randomUUID?.() ?? `r${Date.now()}${Math.random().toString(16).slice(2)}`;
}
