import { h, render } from 'preact';
import { App } from './app.js';

render(h(App, null), document.getElementById('app'));
