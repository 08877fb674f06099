//! The way from a store's callers to one of its background tasks (the committer, the loader): a
//! channel, and a count of what was sent and is not yet in a batch.
//!
//! Why a count beside the channel: a caller decides by it whether to go alone, at once, or to
//! queue behind what waits (a caller that went ahead of queued work would overtake it), and the
//! task reads it to know how much more is coming. The task is started on first use, on the
//! runtime of that use, and started again if that runtime has shut down since (a store outlives
//! the runtime of a test, say); it ends when the store, and with it the sender, is dropped.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::mpsc;

/// A background task's queue, the task started when first needed.
pub(super) struct TaskQueue<T> {
    running: Mutex<Option<Queue<T>>>,
}

/// The way to one running task.
pub(super) struct Queue<T> {
    sender: mpsc::UnboundedSender<T>,
    /// Sent to the task and not yet taken into a batch: the task subtracts what it takes.
    waiting: Arc<AtomicUsize>,
}

// Derived, `Clone` would require `T: Clone`.
impl<T> Clone for Queue<T> {
    fn clone(&self) -> Self {
        Self {
            sender: self.sender.clone(),
            waiting: Arc::clone(&self.waiting),
        }
    }
}

/// The task's end of the queue had closed: the task has stopped.
#[derive(Debug)]
pub(super) struct TaskStopped;

impl<T: Send + 'static> TaskQueue<T> {
    /// No task yet.
    pub fn new() -> Self {
        Self {
            running: Mutex::new(None),
        }
    }

    /// The task's queue, spawning `task` (given the receiving end and the waiting count) if it
    /// is not running: first use, or its runtime has shut down since.
    pub fn get<F, Task>(&self, task: F) -> Queue<T>
    where
        F: FnOnce(mpsc::UnboundedReceiver<T>, Arc<AtomicUsize>) -> Task,
        Task: Future<Output = ()> + Send + 'static,
    {
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        match &*running {
            Some(queue) if !queue.sender.is_closed() => queue.clone(),
            _ => {
                let (sender, receiver) = mpsc::unbounded_channel();
                let started = Queue {
                    sender,
                    waiting: Arc::default(),
                };
                tokio::spawn(task(receiver, Arc::clone(&started.waiting)));
                *running = Some(started.clone());
                started
            }
        }
    }
}

impl<T> Queue<T> {
    /// Whether nothing sent waits to be taken: a caller may go alone without overtaking anyone.
    pub fn is_empty(&self) -> bool {
        self.waiting.load(Ordering::Acquire) == 0
    }

    /// Sends `item` to the task, counted as waiting until the task takes it.
    pub fn send(&self, item: T) -> Result<(), TaskStopped> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        self.sender.send(item).map_err(|_| {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            TaskStopped
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sent_items_wait_until_the_task_takes_them() {
        let queue = TaskQueue::new();
        let (taken, mut got) = mpsc::unbounded_channel();
        let (go, started) = tokio::sync::oneshot::channel::<()>();
        let to_task = queue.get(|mut receiver, waiting: Arc<AtomicUsize>| async move {
            let _ = started.await;
            while let Some(item) = receiver.recv().await {
                waiting.fetch_sub(1, Ordering::AcqRel);
                let _ = taken.send(item);
            }
        });
        assert!(to_task.is_empty());
        to_task.send(1).unwrap();
        to_task.send(2).unwrap();
        assert!(!to_task.is_empty(), "two sent, none taken");
        // The same task's queue, not a second task.
        let again = queue.get(|_, _| -> std::future::Ready<()> {
            unreachable!("the task is running: no second one starts")
        });
        go.send(()).unwrap();
        assert_eq!(got.recv().await, Some(1));
        assert_eq!(got.recv().await, Some(2));
        assert!(again.is_empty());
    }

    #[test]
    fn a_task_whose_runtime_shut_down_is_started_again() {
        let queue = TaskQueue::<u32>::new();
        let start = |tag: u32| {
            move |mut receiver: mpsc::UnboundedReceiver<u32>, _: Arc<AtomicUsize>| async move {
                while receiver.recv().await.is_some() {}
                let _ = tag;
            }
        };
        let first = tokio::runtime::Runtime::new().unwrap();
        let old = first.block_on(async { queue.get(start(1)) });
        drop(first);
        assert!(old.send(1).is_err(), "the first runtime's task is gone");
        assert!(old.is_empty(), "a failed send is not counted as waiting");
        let second = tokio::runtime::Runtime::new().unwrap();
        let new = second.block_on(async { queue.get(start(2)) });
        assert!(new.send(2).is_ok(), "a new task took over");
    }
}
