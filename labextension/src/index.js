// @elastic-gpu/jupyterlab: what a notebook user needs to know about their GPU kernel, in JupyterLab.
//
// - a status-bar item for the active notebook's GPU kernel: its slice (memory in use / guaranteed,
//   compute share) or its state (swapped out, queued, stopped and why), and the culler's deadline;
// - notifications (JupyterLab's Notification API) when a GPU kernel is swapped out, waits in the
//   GPU queue (each change of position), is back on a GPU, or is stopped by the hub (an admin's
//   reason), and for the culler's warning printed in the kernel.
//
// Every word shown comes from the server extension (kernelprovider/labstatus.py), which asks the
// hub's broker with the server's own token; this file only decides when to show them.
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ServerConnection } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

const POLL_MS = 2000;
// the culler's warning printed in the kernel starts with this (culler/warn.py)
const CULLER_MARK = '[elastic-gpu] This kernel';
// events worth a notification the first time a kernel is seen in them
const TOLD_ON_SIGHT = new Set(['swapped', 'stopped']);

/** The server extension's view of this server's GPU kernels: {kernels: {id: view}, unavailable}. */
async function fetchKernels(settings) {
  const url = URLExt.join(settings.baseUrl, 'elastic-gpu', 'kernels');
  const response = await ServerConnection.makeRequest(url, {}, settings);
  if (!response.ok) {
    return { kernels: {}, unavailable: `HTTP ${response.status}` };
  }
  return response.json();
}

/** When the culler's warning says the kernel goes ("at 12:34:56 UTC"), as a Date today or tomorrow. */
function dueFrom(text) {
  const m = /at (\d\d):(\d\d):(\d\d) UTC/i.exec(text);
  if (!m) {
    return null;
  }
  const due = new Date();
  due.setUTCHours(+m[1], +m[2], +m[3], 0);
  if (due.getTime() < Date.now() - 12 * 3600 * 1000) {
    due.setUTCDate(due.getUTCDate() + 1);
  }
  return due;
}

class GPUStatus extends Widget {
  constructor() {
    super();
    this.addClass('egpu-status');
    this.node.title = 'Your GPU kernel (Elastic GPU)';
    this.hide();
  }

  show_(view, warning) {
    if (!view) {
      this.node.textContent = '';
      this.node.dataset.state = '';
      this.hide();
      return;
    }
    let text = view.status;
    if (warning && view.event === 'running') {
      const minutes = Math.max(1, Math.ceil((warning.due.getTime() - Date.now()) / 60000));
      text += ` · idle: ${warning.swap ? 'swapped out' : 'stopped'} in ${minutes} min`;
    }
    this.node.textContent = text;
    this.node.dataset.state = view.event.split(':')[0];
    this.node.title = view.detail || view.status;
    this.show();
  }
}

function activate(app, tracker, statusBar) {
  const settings = ServerConnection.makeSettings();
  const item = new GPUStatus();
  const seen = new Map(); // kernel id -> last event
  const notices = new Map(); // kernel id -> id of its notification (updated, not stacked)
  const warnings = new Map(); // kernel id -> {due, swap} from the culler's warning
  let kernels = {};

  if (statusBar) {
    statusBar.registerStatusItem('elastic-gpu:status', { item, align: 'left', rank: 5 });
  }

  const lastKernel = new WeakMap(); // notebook panel -> its last kernel id (a stopped kernel leaves none)
  const activeKernelId = () => {
    const panel = tracker.currentWidget;
    if (!panel) {
      return null;
    }
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    if (kernel) {
      lastKernel.set(panel, kernel.id);
      return kernel.id;
    }
    const last = lastKernel.get(panel);
    return last && kernels[last] && kernels[last].event === 'stopped' ? last : null;
  };
  const refreshItem = () => {
    const id = activeKernelId();
    item.show_(id ? kernels[id] : null, id ? warnings.get(id) : null);
  };

  // a notification shows NOTICE_CHARS of its message: the whole text is one click away
  const details = (title, text) => [
    {
      label: 'Details',
      callback: () => showDialog({ title, body: text, buttons: [Dialog.okButton()] })
    }
  ];

  // what this browser was told already (a page reload must not tell a stopped kernel's news again)
  const toldKey = (id, event) => `elastic-gpu:told:${id}:${event}`;
  const toldBefore = (id, event) => {
    try {
      return window.localStorage.getItem(toldKey(id, event)) !== null;
    } catch (e) {
      return false;
    }
  };

  const tell = (id, view) => {
    try {
      window.localStorage.setItem(toldKey(id, view.event), String(Date.now()));
    } catch (e) {
      // no storage (private window): told again after a reload, nothing worse
    }
    const kind = ['info', 'success', 'warning', 'error'].includes(view.level) ? view.level : 'info';
    const options = {
      autoClose: kind === 'error' || kind === 'warning' ? false : 8000,
      actions: view.detail ? details('Your GPU kernel', view.detail) : []
    };
    const previous = notices.get(id);
    if (previous && Notification.manager.has(previous)) {
      Notification.update({ id: previous, message: view.notice, type: kind, ...options });
    } else {
      notices.set(id, Notification.emit(view.notice, kind, options));
    }
  };

  const poll = async () => {
    try {
      const answer = await fetchKernels(settings);
      kernels = answer.kernels || {};
    } catch (e) {
      return; // the server restarting: the next poll asks again
    }
    for (const [id, view] of Object.entries(kernels)) {
      const before = seen.get(id);
      seen.set(id, view.event);
      if (!view.notice || before === view.event) {
        continue;
      }
      const onSight = TOLD_ON_SIGHT.has(view.event) && !toldBefore(id, view.event);
      if (before === undefined ? onSight : !(before === 'pending' && view.event === 'running')) {
        if (view.event !== 'running' || (before || '').match(/^(swapped|queued)/)) {
          tell(id, view);
        }
      }
      if (view.event !== 'running') {
        warnings.delete(id);
      }
    }
    refreshItem();
  };

  const watchWarnings = (panel) => {
    panel.sessionContext.iopubMessage.connect((context, msg) => {
      if (msg.header.msg_type !== 'stream' || !String(msg.content.text || '').startsWith(CULLER_MARK)) {
        return;
      }
      const text = String(msg.content.text).replace('[elastic-gpu] ', '').trim();
      const kernel = context.session && context.session.kernel;
      const due = dueFrom(text);
      if (kernel && due) {
        warnings.set(kernel.id, { due, swap: /swapped out/.test(text) && !/shut down at/.test(text) });
      }
      // the sentence that says when (the culler's text is longer than a notification shows)
      const when = text.split(/(?<=\.) (?=[A-Z])/).find(part => /\d\d:\d\d:\d\d UTC/.test(part)) || text;
      Notification.warning(`Idle GPU kernel: ${when}`, {
        autoClose: false,
        actions: details('Idle GPU kernel', text)
      });
      refreshItem();
    });
  };

  tracker.widgetAdded.connect((_, panel) => watchWarnings(panel));
  tracker.forEach(watchWarnings);
  tracker.currentChanged.connect(refreshItem);
  const timer = setInterval(poll, POLL_MS);
  void poll();
  return { dispose: () => clearInterval(timer) };
}

const plugin = {
  id: '@elastic-gpu/jupyterlab:plugin',
  description: 'Your GPU slice, its state and what happens to it, in JupyterLab.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar],
  activate
};

export default plugin;
