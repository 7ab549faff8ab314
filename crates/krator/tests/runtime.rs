//! The runtime on its own, under paused time: transitions, manifest changes,
//! deletion, re-application, panics and shutdown.

use std::sync::Arc;
use std::time::Duration;

use krator::{Applied, Context, Deleted, Machine, Outcome, Runtime, State, Transition, TransitionTo};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What the test machine reports: state entries, statuses reported from inside
/// a state, and how each task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Entered(String, String),
    Finished(String, String),
}

/// The manifest: how many rounds of work a job does before it completes
/// (`None`: work until deleted), and whether to panic.
#[derive(Debug, Clone, PartialEq)]
struct Job {
    rounds: Option<u32>,
    panic: bool,
    cleanup_panics: bool,
    cleanup_delay: Duration,
}

impl Job {
    fn forever() -> Self {
        Job { rounds: None, panic: false, cleanup_panics: false, cleanup_delay: Duration::ZERO }
    }
}

struct Jobs {
    events: mpsc::UnboundedSender<Event>,
}

#[derive(Debug, Default)]
struct JobData {
    rounds_done: u32,
    cleanups: u32,
}

impl Machine for Jobs {
    type Key = String;
    type Manifest = Job;
    type Data = JobData;
    type Status = String;
    type Error = String;

    fn start(&self, _key: &String, _manifest: &Job) -> (JobData, Box<dyn State<Self>>) {
        (JobData::default(), Box::new(Queued))
    }

    fn deleted(&self, _key: &String, _data: &JobData) -> Box<dyn State<Self>> {
        Box::new(Cleanup)
    }

    fn status(&self, key: &String, status: String) {
        let _ = self.events.send(Event::Entered(key.clone(), status));
    }

    fn finished(&self, key: &String, outcome: &Outcome<String>) {
        let outcome = match outcome {
            Outcome::Completed(Ok(())) => "ok".to_string(),
            Outcome::Completed(Err(error)) => format!("error: {error}"),
            Outcome::Panicked(message) => format!("panic: {message}"),
            Outcome::ShutDown => "shutdown".to_string(),
        };
        let _ = self.events.send(Event::Finished(key.clone(), outcome));
    }
}

struct Queued;
struct Working {
    round: u32,
}
struct Resting;
struct Done;
struct Cleanup;

impl TransitionTo<Working> for Queued {}
impl TransitionTo<Resting> for Working {}
impl TransitionTo<Done> for Working {}
impl TransitionTo<Working> for Resting {}

#[async_trait::async_trait]
impl State<Jobs> for Queued {
    async fn next(self: Box<Self>, ctx: &mut Context<Jobs>) -> Transition<Jobs> {
        if ctx.latest_manifest().panic {
            panic!("job asked to panic");
        }
        Transition::next(&*self, Working { round: 1 })
    }

    fn status(&self, _ctx: &Context<Jobs>) -> String {
        "queued".into()
    }
}

#[async_trait::async_trait]
impl State<Jobs> for Working {
    async fn next(self: Box<Self>, ctx: &mut Context<Jobs>) -> Transition<Jobs> {
        // One round of work takes a minute (paused time makes it instant unless
        // something else is pending).
        tokio::time::sleep(Duration::from_secs(60)).await;
        ctx.data.rounds_done = self.round;
        match ctx.latest_manifest().rounds {
            Some(rounds) if self.round >= rounds => Transition::next(&*self, Done),
            _ => Transition::next(&*self, Resting),
        }
    }

    fn status(&self, _ctx: &Context<Jobs>) -> String {
        format!("working round {}", self.round)
    }
}

#[async_trait::async_trait]
impl State<Jobs> for Resting {
    async fn next(self: Box<Self>, ctx: &mut Context<Jobs>) -> Transition<Jobs> {
        // Rest until the manifest changes; a changed manifest starts the next round.
        if ctx.manifest.changed().await.is_err() {
            return Transition::complete(Err("manifest sender gone".into()));
        }
        ctx.report(format!("manifest changed after {} rounds", ctx.data.rounds_done));
        Transition::next(&*self, Working { round: ctx.data.rounds_done + 1 })
    }

    fn status(&self, ctx: &Context<Jobs>) -> String {
        format!("resting after {} rounds", ctx.data.rounds_done)
    }
}

#[async_trait::async_trait]
impl State<Jobs> for Done {
    async fn next(self: Box<Self>, ctx: &mut Context<Jobs>) -> Transition<Jobs> {
        assert!(!ctx.is_deleting(), "a deleted job never reaches Done");
        Transition::complete(Ok(()))
    }

    fn status(&self, _ctx: &Context<Jobs>) -> String {
        "done".into()
    }
}

#[async_trait::async_trait]
impl State<Jobs> for Cleanup {
    async fn next(self: Box<Self>, ctx: &mut Context<Jobs>) -> Transition<Jobs> {
        tokio::time::sleep(ctx.latest_manifest().cleanup_delay).await;
        if ctx.latest_manifest().cleanup_panics {
            panic!("cleanup asked to panic");
        }
        ctx.data.cleanups += 1;
        ctx.report(format!("cleaned up after {} rounds", ctx.data.rounds_done));
        Transition::complete(Ok(()))
    }

    fn status(&self, _ctx: &Context<Jobs>) -> String {
        "cleaning up".into()
    }
}

struct Harness {
    runtime: Runtime<Jobs>,
    events: mpsc::UnboundedReceiver<Event>,
    shutdown: CancellationToken,
}

impl Harness {
    fn new() -> Self {
        let (sender, events) = mpsc::unbounded_channel();
        let shutdown = CancellationToken::new();
        let runtime = Runtime::new(Arc::new(Jobs { events: sender }), shutdown.clone());
        Harness { runtime, events, shutdown }
    }

    async fn next_event(&mut self) -> Event {
        self.events.recv().await.expect("the machine keeps its sender")
    }

    /// Collects events until `key` finishes; returns them in order.
    async fn until_finished(&mut self, key: &str) -> Vec<Event> {
        let mut seen = Vec::new();
        loop {
            let event = self.next_event().await;
            let last = matches!(&event, Event::Finished(k, _) if k == key);
            seen.push(event);
            if last {
                return seen;
            }
        }
    }
}

fn entered(key: &str, status: &str) -> Event {
    Event::Entered(key.into(), status.into())
}

fn finished(key: &str, outcome: &str) -> Event {
    Event::Finished(key.into(), outcome.into())
}

#[tokio::test(start_paused = true)]
async fn states_follow_their_transitions_and_report_each_entry() {
    let mut h = Harness::new();
    let job = Job { rounds: Some(1), ..Job::forever() };
    assert_eq!(h.runtime.apply("a".into(), job), Applied::Started);
    let events = h.until_finished("a").await;
    assert_eq!(
        events,
        [entered("a", "queued"), entered("a", "working round 1"), entered("a", "done"), finished("a", "ok")]
    );
    assert!(!h.runtime.contains(&"a".to_string()));
}

#[tokio::test(start_paused = true)]
async fn a_state_sees_the_manifest_change() {
    let mut h = Harness::new();
    let key = "a".to_string();
    h.runtime.apply(key.clone(), Job { rounds: Some(2), ..Job::forever() });
    assert_eq!(h.next_event().await, entered("a", "queued"));
    assert_eq!(h.next_event().await, entered("a", "working round 1"));
    assert_eq!(h.next_event().await, entered("a", "resting after 1 rounds"));
    // Resting waits for a change: with nothing else to do, paused time would
    // advance forever without one.
    assert_eq!(
        h.runtime.apply(key.clone(), Job { rounds: Some(2), cleanup_delay: Duration::from_secs(1), ..Job::forever() }),
        Applied::Updated
    );
    let events = h.until_finished("a").await;
    assert_eq!(
        events,
        [
            entered("a", "manifest changed after 1 rounds"),
            entered("a", "working round 2"),
            entered("a", "done"),
            finished("a", "ok")
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn deletion_interrupts_the_current_state_and_runs_the_terminal_states() {
    let mut h = Harness::new();
    let key = "a".to_string();
    h.runtime.apply(key.clone(), Job::forever());
    assert_eq!(h.next_event().await, entered("a", "queued"));
    assert_eq!(h.next_event().await, entered("a", "working round 1"));
    // The round takes a minute of (paused) time; deleting now interrupts it.
    let started = tokio::time::Instant::now();
    assert_eq!(h.runtime.delete(&key), Deleted::Deleting);
    let events = h.until_finished("a").await;
    assert_eq!(events, [entered("a", "cleaning up"), entered("a", "cleaned up after 0 rounds"), finished("a", "ok")]);
    assert!(started.elapsed() < Duration::from_secs(60), "the working round was not interrupted");
    assert!(!h.runtime.contains(&key));
    assert_eq!(h.runtime.delete(&key), Deleted::NotFound);
}

#[tokio::test(start_paused = true)]
async fn a_second_delete_does_not_interrupt_the_terminal_states() {
    let mut h = Harness::new();
    let key = "a".to_string();
    h.runtime.apply(key.clone(), Job { cleanup_delay: Duration::from_secs(30), ..Job::forever() });
    assert_eq!(h.next_event().await, entered("a", "queued"));
    assert_eq!(h.next_event().await, entered("a", "working round 1"));
    assert_eq!(h.runtime.delete(&key), Deleted::Deleting);
    assert_eq!(h.next_event().await, entered("a", "cleaning up"));
    assert_eq!(h.runtime.delete(&key), Deleted::AlreadyDeleting);
    let events = h.until_finished("a").await;
    assert_eq!(events, [entered("a", "cleaned up after 0 rounds"), finished("a", "ok")]);
}

#[tokio::test(start_paused = true)]
async fn applying_a_deleting_object_starts_it_again_after_cleanup() {
    let mut h = Harness::new();
    let key = "a".to_string();
    h.runtime.apply(key.clone(), Job { cleanup_delay: Duration::from_secs(30), ..Job::forever() });
    assert_eq!(h.next_event().await, entered("a", "queued"));
    assert_eq!(h.next_event().await, entered("a", "working round 1"));
    h.runtime.delete(&key);
    assert_eq!(h.next_event().await, entered("a", "cleaning up"));
    assert_eq!(h.runtime.apply(key.clone(), Job { rounds: Some(1), ..Job::forever() }), Applied::Queued);
    let events = h.until_finished("a").await;
    assert_eq!(events, [entered("a", "cleaned up after 0 rounds"), finished("a", "ok")]);
    // The queued manifest starts a fresh object with fresh data.
    let events = h.until_finished("a").await;
    assert_eq!(
        events,
        [entered("a", "queued"), entered("a", "working round 1"), entered("a", "done"), finished("a", "ok")]
    );
    assert!(!h.runtime.contains(&key));
}

#[tokio::test(start_paused = true)]
async fn a_second_delete_drops_a_queued_reapply() {
    let mut h = Harness::new();
    let key = "a".to_string();
    h.runtime.apply(key.clone(), Job { cleanup_delay: Duration::from_secs(30), ..Job::forever() });
    assert_eq!(h.next_event().await, entered("a", "queued"));
    assert_eq!(h.next_event().await, entered("a", "working round 1"));
    h.runtime.delete(&key);
    assert_eq!(h.next_event().await, entered("a", "cleaning up"));
    assert_eq!(h.runtime.apply(key.clone(), Job::forever()), Applied::Queued);
    assert_eq!(h.runtime.delete(&key), Deleted::AlreadyDeleting);
    let events = h.until_finished("a").await;
    assert_eq!(events, [entered("a", "cleaned up after 0 rounds"), finished("a", "ok")]);
    assert!(!h.runtime.contains(&key));
    // Nothing was restarted: the next event is one we cause.
    h.runtime.apply("b".into(), Job { rounds: Some(1), ..Job::forever() });
    assert_eq!(h.next_event().await, entered("b", "queued"));
}

#[tokio::test(start_paused = true)]
async fn a_panicking_state_runs_the_terminal_states_of_only_its_own_object() {
    let mut h = Harness::new();
    h.runtime.apply("steady".into(), Job::forever());
    assert_eq!(h.next_event().await, entered("steady", "queued"));
    assert_eq!(h.next_event().await, entered("steady", "working round 1"));
    h.runtime.apply("broken".into(), Job { panic: true, ..Job::forever() });
    let events = h.until_finished("broken").await;
    assert_eq!(
        events,
        [
            entered("broken", "queued"),
            entered("broken", "cleaning up"),
            entered("broken", "cleaned up after 0 rounds"),
            finished("broken", "ok")
        ],
        "the panic moved it to its terminal states, which released it"
    );
    assert!(!h.runtime.contains(&"broken".to_string()));
    assert!(h.runtime.contains(&"steady".to_string()));
    // The steady object still works: it finishes its round and rests.
    assert_eq!(h.next_event().await, entered("steady", "resting after 1 rounds"));
}

#[tokio::test(start_paused = true)]
async fn a_panic_in_the_terminal_states_ends_the_object() {
    let mut h = Harness::new();
    h.runtime.apply("doomed".into(), Job { panic: true, cleanup_panics: true, ..Job::forever() });
    let events = h.until_finished("doomed").await;
    assert_eq!(
        events,
        [
            entered("doomed", "queued"),
            entered("doomed", "cleaning up"),
            finished("doomed", "panic: cleanup asked to panic")
        ]
    );
    assert!(!h.runtime.contains(&"doomed".to_string()));
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_objects_without_running_terminal_states() {
    let mut h = Harness::new();
    for key in ["a", "b"] {
        h.runtime.apply(key.into(), Job::forever());
    }
    let mut working = 0;
    while working < 2 {
        if let Event::Entered(_, status) = h.next_event().await
            && status.starts_with("working")
        {
            working += 1;
        }
    }
    h.shutdown.cancel();
    h.runtime.stopped().await;
    let mut rest = Vec::new();
    while let Ok(event) = h.events.try_recv() {
        rest.push(event);
    }
    rest.sort_by_key(|event| format!("{event:?}"));
    assert_eq!(rest, [finished("a", "shutdown"), finished("b", "shutdown")]);
}

#[tokio::test(start_paused = true)]
async fn many_objects_run_independently() {
    let mut h = Harness::new();
    for i in 0..100 {
        h.runtime.apply(format!("job-{i}"), Job { rounds: Some(1 + i % 3), ..Job::forever() });
    }
    // Jobs needing more than one round rest until their manifest changes.
    let mut done = 0;
    let mut resting = 0;
    while done + resting < 100 {
        match h.next_event().await {
            Event::Entered(_, status) if status.starts_with("resting") => resting += 1,
            Event::Finished(_, outcome) => {
                assert_eq!(outcome, "ok");
                done += 1;
            }
            _ => {}
        }
    }
    assert_eq!(done, 34);
    assert_eq!(h.runtime.keys().len(), 66);
}
