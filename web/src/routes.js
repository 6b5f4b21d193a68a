// Client routes: `/` and `/sessions/<id>`.

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

export function parseRoute(pathname) {
  const m = /^\/sessions\/([^/]+)\/?$/.exec(pathname || '/');
  if (m && UUID.test(decodeURIComponent(m[1]))) return { name: 'session', id: decodeURIComponent(m[1]).toLowerCase() };
  if (m) return { name: 'not_found' };
  return { name: 'home' };
}

export function sessionHref(id) {
  return `/sessions/${id}`;
}
