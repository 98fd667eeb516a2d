// @elastic-gpu/jupyterlab: what a notebook user needs to know about their GPU kernel, in JupyterLab.
//
// - a status-bar item for the active notebook's GPU kernel: its slice (memory in use / guaranteed,
//   compute share) or its state (waiting in the GPU queue to start, swapped out, queued, stopped and
//   why), and the culler's deadline (the broker's idle_deadline, counted down by the server extension);
// - notifications (JupyterLab's Notification API) when a GPU kernel waits in the GPU queue to start or
//   to run its next cell (each change of position), starts after waiting, is swapped out, is back on
//   a GPU, or is stopped by the hub (an admin's reason), and the culler's warning printed in the kernel
//   (shown as it is worded; nothing is read from its words).
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
// kinds of events worth a notification the first time a kernel is seen in them
const TOLD_ON_SIGHT = new Set(['swapped', 'stopped', 'waiting']);
const kindOf = event => String(event || '').split(':')[0];

/** The server extension's view of this server's GPU kernels: {kernels: {id: view}, unavailable}. */
async function fetchKernels(settings) {
  const url = URLExt.join(settings.baseUrl, 'elastic-gpu', 'kernels');
  const response = await ServerConnection.makeRequest(url, {}, settings);
  if (!response.ok) {
    return { kernels: {}, unavailable: `HTTP ${response.status}` };
  }
  return response.json();
}

class GPUStatus extends Widget {
  constructor() {
    super();
    this.addClass('egpu-status');
    this.node.title = 'Your GPU kernel (Elastic GPU)';
    this.hide();
  }

  show_(view) {
    if (!view) {
      this.node.textContent = '';
      this.node.dataset.state = '';
      this.hide();
      return;
    }
    this.node.textContent = view.status;
    this.node.dataset.state = kindOf(view.event);
    this.node.title = view.detail || view.status;
    this.show();
  }
}

function activate(app, tracker, statusBar) {
  const settings = ServerConnection.makeSettings();
  const item = new GPUStatus();
  const seen = new Map(); // kernel id -> last event
  const notices = new Map(); // kernel id -> id of its notification (updated, not stacked)
  const waited = new Set(); // kernel ids seen waiting in the GPU queue to start
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
    if (last && kernels[last] && kernels[last].event === 'stopped') {
      return last;
    }
    // no kernel yet: JupyterLab's start of it is under way, the server knows it by the notebook's path
    const path = panel.context && panel.context.path;
    const starting = Object.entries(kernels).find(
      ([, view]) => view.path && view.path === path && ['pending', 'waiting'].includes(kindOf(view.event))
    );
    return starting ? starting[0] : null;
  };
  const refreshItem = () => {
    const id = activeKernelId();
    item.show_(id ? kernels[id] : null);
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

  const tell = (id, view, notice = view.notice) => {
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
      Notification.update({ id: previous, message: notice, type: kind, ...options });
    } else {
      notices.set(id, Notification.emit(notice, kind, options));
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
      if (kindOf(view.event) === 'waiting') {
        waited.add(id);
      }
      if (!view.notice || before === view.event) {
        continue;
      }
      if (view.event === 'running' && waited.delete(id)) {
        tell(id, view, view.started); // it waited to start: it has its GPU now
        continue;
      }
      const onSight = TOLD_ON_SIGHT.has(kindOf(view.event)) && !toldBefore(id, view.event);
      if (before === undefined ? onSight : !(before === 'pending' && view.event === 'running')) {
        if (view.event !== 'running' || (before || '').match(/^(swapped|queued)/)) {
          tell(id, view);
        }
      }
    }
    refreshItem();
  };

  const watchWarnings = (panel) => {
    panel.sessionContext.iopubMessage.connect((context, msg) => {
      if (msg.header.msg_type !== 'stream' || !String(msg.content.text || '').startsWith(CULLER_MARK)) {
        return;
      }
      // shown as worded, cut where JupyterLab cuts a notification; the whole of it one click away
      // (the countdown in the status item is the broker's idle_deadline, not read from these words)
      const text = String(msg.content.text).replace('[elastic-gpu] ', '').trim();
      const sentences = text.split(/(?<=\.) (?=[A-Z])/);
      const when = sentences.find(part => /\d\d:\d\d(:\d\d)? UTC/.test(part)) || sentences[0] || text;
      Notification.warning(`Idle GPU kernel: ${when}`, {
        autoClose: false,
        actions: details('Idle GPU kernel', text)
      });
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
