import { useState, useRef, useCallback, useEffect } from 'preact/hooks';
import { runtimeFor } from './runtime.js';

/** A request the user started: pending while it runs, its error kept with
 * a retry that repeats exactly the same request. */
export function useAction() {
  const [state, setState] = useState({ pending: false, error: null });
  const last = useRef(null);
  const run = useCallback(async (fn) => {
    last.current = fn;
    setState({ pending: true, error: null });
    try {
      const out = await fn();
      setState({ pending: false, error: null });
      return { ok: true, out };
    } catch (error) {
      setState({ pending: false, error });
      return { ok: false, error };
    }
  }, []);
  const retry = useCallback(() => (last.current ? run(last.current) : undefined), [run]);
  const clear = useCallback(() => setState({ pending: false, error: null }), []);
  return { ...state, run, retry, clear };
}

/** The shared observation of a tree; re-renders on every change. */
export function useRuntime(rootId) {
  const rt = runtimeFor(rootId);
  const [, setVersion] = useState(0);
  useEffect(() => rt.subscribe((v) => setVersion(v)), [rt]);
  return rt;
}

/** Width of an element, kept current. */
export function useWidth(ref) {
  const [width, setWidth] = useState(0);
  useEffect(() => {
    const el = ref.current;
    if (!el) return undefined;
    const ro = new ResizeObserver(() => setWidth(el.clientWidth));
    ro.observe(el);
    setWidth(el.clientWidth);
    return () => ro.disconnect();
  }, [ref.current]);
  return width;
}
