//! `/logs/`: the node's own logs, as the kubelet serves them.
//!
//! - `enableSystemLogHandler` (default on): the node's log directory
//!   (`/var/log`) read-only, a directory as a listing of links, a file as
//!   its bytes; off, every `/logs/` request is answered `405 logs endpoint
//!   is disabled.`
//! - The log query (`enableSystemLogQuery` with the `NodeLogQuery` gate):
//!   `/logs/?query=<service>|<file>` with `sinceTime`, `untilTime`,
//!   `tailLines`, `pattern` and `boot`. A service that logs to the journal
//!   is read with `journalctl` (upstream's arguments: `--utc --no-pager
//!   --output=short-precise --unit=<service> ...`); one that does not is
//!   looked for as `<dir>/<service>`, `<dir>/<service>.log`,
//!   `<dir>/<service>/<service>.log`, in that order. A query with a `/` is a
//!   file under the log dir. Bad parameters: `400` (parsing) or `406`
//!   (checks), with upstream's field errors. The answer is gzipped when the
//!   client sends `Accept-Encoding: gzip`. A query has 30 s in all.
//!
//! Nothing outside the log dir is served: paths are cleaned first, and a
//! symbolic link that leads out of the dir is refused.

use std::io::Write as _;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use tokio::io::AsyncReadExt as _;

use crate::state::text;

/// Upstream's limits: services in one query, a service name's length,
/// `tailLines`.
const MAX_SERVICES: usize = 4;
const MAX_SERVICE_LENGTH: usize = 256;
const MAX_TAIL_LINES: i64 = 100_000;
/// A query's deadline, journal and files together.
const QUERY_DEADLINE: Duration = Duration::from_secs(30);

/// How `/logs/` is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SystemLogSettings {
    /// `enableSystemLogHandler`: serve the log dir at all.
    pub handler: bool,
    /// `enableSystemLogQuery` (with the `NodeLogQuery` gate): answer
    /// `?query=`.
    pub query: bool,
    /// The node's log dir (`/var/log`).
    pub dir: PathBuf,
    /// The journal reader (`journalctl`, looked up on `PATH`).
    pub journalctl: PathBuf,
}

impl Default for SystemLogSettings {
    /// The kubelet's defaults: the handler on, the query off, `/var/log`.
    fn default() -> Self {
        SystemLogSettings {
            handler: true,
            query: false,
            dir: PathBuf::from("/var/log"),
            journalctl: PathBuf::from("journalctl"),
        }
    }
}

/// One field error, written as apimachinery writes it
/// (`query: Invalid value: "x": detail`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldError(String);

fn invalid(field: &str, value: &str, detail: &str) -> FieldError {
    FieldError(format!("{field}: Invalid value: {value}: {detail}"))
}

/// A Go `%q` of a string (enough for what a query carries).
fn quoted(value: &str) -> String {
    format!("{value:?}")
}

/// A Go `%#v` of a `[]string`.
fn string_list(values: &[String]) -> String {
    format!("[]string{{{}}}", values.iter().map(|v| quoted(v)).collect::<Vec<_>>().join(", "))
}

/// Upstream's aggregate: one error alone, several in brackets.
fn aggregate(errors: &[FieldError]) -> String {
    match errors {
        [one] => one.0.clone(),
        many => format!("[{}]", many.iter().map(|e| e.0.as_str()).collect::<Vec<_>>().join(", ")),
    }
}

/// The options that apply to services only.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Options {
    since: Option<jiff::Timestamp>,
    until: Option<jiff::Timestamp>,
    tail_lines: Option<i64>,
    boot: Option<i64>,
    pattern: String,
}

impl Options {
    fn any(&self) -> bool {
        *self != Options::default()
    }
}

/// A parsed `/logs/?...` query.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct NodeLogQuery {
    services: Vec<String>,
    files: Vec<String>,
    options: Options,
}

/// Decodes a query string into its pairs (`%XX` and `+` decoded); a key
/// without `=` has an empty value.
fn pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(key), decode(value))
        })
        .collect()
}

/// `%XX` and `+` decoded; a value that does not decode stays as it is.
fn decode(value: &str) -> String {
    crate::streaming::percent_decode(value).unwrap_or_else(|| value.to_owned())
}

fn first<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty())
}

/// Go's `strconv.Atoi` error, as upstream's field error carries it.
fn atoi(field: &str, value: &str) -> Result<i64, FieldError> {
    value.parse::<i64>().map_err(|e| {
        let why = if matches!(e.kind(), std::num::IntErrorKind::PosOverflow | std::num::IntErrorKind::NegOverflow) {
            "value out of range"
        } else {
            "invalid syntax"
        };
        invalid(field, &quoted(value), &format!("strconv.Atoi: parsing {}: {why}", quoted(value)))
    })
}

impl NodeLogQuery {
    /// Parses the query as upstream's `newNodeLogQuery`: `None` when it
    /// holds nothing the log query reads (then the path is a file).
    fn parse(query: &str) -> Result<Option<NodeLogQuery>, Vec<FieldError>> {
        let pairs = pairs(query);
        let mut errors = Vec::new();
        let mut parsed = NodeLogQuery::default();
        let queries: Vec<String> = pairs.iter().filter(|(k, _)| k == "query").map(|(_, v)| v.clone()).collect();
        for q in &queries {
            // A `/` or `\` says it is a file.
            if q.contains(['/', '\\']) {
                parsed.files.push(q.clone());
            } else if !q.trim().is_empty() {
                parsed.services.push(q.clone());
            }
        }
        if !queries.is_empty() && parsed.files.is_empty() && parsed.services.is_empty() {
            errors.push(invalid("query", &string_list(&queries), "query cannot be empty"));
        }
        let time = |field: &str| -> Result<Option<jiff::Timestamp>, FieldError> {
            first(&pairs, field)
                .map(|v| v.parse::<jiff::Timestamp>().map_err(|_| invalid(field, &quoted(v), "invalid time format")))
                .transpose()
        };
        match time("sinceTime") {
            Ok(t) => parsed.options.since = t,
            Err(e) => errors.push(e),
        }
        match time("untilTime") {
            Ok(t) => parsed.options.until = t,
            Err(e) => errors.push(e),
        }
        for (field, slot) in [("boot", &mut parsed.options.boot), ("tailLines", &mut parsed.options.tail_lines)] {
            if let Some(value) = first(&pairs, field) {
                match atoi(field, value) {
                    Ok(n) => *slot = Some(n),
                    Err(e) => errors.push(e),
                }
            }
        }
        if let Some(pattern) = first(&pairs, "pattern") {
            parsed.options.pattern = pattern.to_owned();
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(if parsed == NodeLogQuery::default() { None } else { Some(parsed) })
    }

    /// Upstream's checks of a parsed query (`validate`), against `dir`.
    fn validate(&self, dir: &Path) -> Vec<FieldError> {
        let mut errors = Vec::new();
        for service in &self.services {
            if service.len() > MAX_SERVICE_LENGTH {
                errors.push(invalid("query", &quoted(service), "length must be less than 100"));
            } else if !service.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'@')) {
                errors.push(invalid("query", &quoted(service), "input contains unsupported characters"));
            }
        }
        if self.services.len() > MAX_SERVICES {
            errors.push(FieldError(format!(
                "query: Too many: {}: must have at most {MAX_SERVICES} items",
                self.services.len()
            )));
        }
        match (self.files.as_slice(), self.services.is_empty()) {
            ([], true) => errors.push(FieldError("query: Required value: cannot be empty with options".into())),
            ([_, ..], false) => errors.push(invalid(
                "query",
                &quoted(&format!("[{}], [{}]", self.files.join(" "), self.services.join(" "))),
                "cannot specify a file and service",
            )),
            ([_, _, ..], true) => {
                errors.push(invalid("query", &string_list(&self.files), "cannot specify more than one file"))
            }
            ([_], true) if self.options.any() => {
                errors.push(invalid("query", &string_list(&self.files), "cannot specify file with options"));
            }
            ([file], true) => {
                if let Err(why) = within(dir, file).and_then(|path| {
                    std::fs::metadata(&path).map(|_| ()).map_err(|e| format!("stat {}: {e}", path.display()))
                }) {
                    errors.push(invalid("query", &string_list(&self.files), &why));
                }
            }
            ([], false) => {}
        }
        let options = &self.options;
        if let (Some(since), Some(until)) = (options.since, options.until)
            && since > until
        {
            errors.push(invalid("untilTime", &until.to_string(), "must be after `sinceTime`"));
        }
        if let Some(boot) = options.boot
            && boot > 0
        {
            errors.push(invalid("boot", &boot.to_string(), "must be less than 1"));
        }
        if let Some(lines) = options.tail_lines
            && !(0..=MAX_TAIL_LINES).contains(&lines)
        {
            errors.push(invalid(
                "tailLines",
                &lines.to_string(),
                &format!("must be between 0 and {MAX_TAIL_LINES}, inclusive"),
            ));
        }
        if let Err(error) = regex::Regex::new(&options.pattern) {
            let detail = error.to_string().lines().last().unwrap_or_default().trim().to_owned();
            errors.push(invalid("pattern", &quoted(&options.pattern), &format!("error parsing regexp: {detail}")));
        }
        errors
    }

    /// `journalctl`'s arguments for `services`, as upstream passes them.
    fn journal_args(&self, services: &[String]) -> Vec<String> {
        // journalctl's own date form (upstream's `2006-1-2 15:4:5`), in UTC.
        let date = |t: jiff::Timestamp| t.strftime("%Y-%-m-%-d %-H:%-M:%-S").to_string();
        let mut args: Vec<String> = ["--utc", "--no-pager", "--output=short-precise"].map(String::from).to_vec();
        let options = &self.options;
        if let Some(since) = options.since {
            args.push(format!("--since={}", date(since)));
        }
        if let Some(until) = options.until {
            args.push(format!("--until={}", date(until)));
        }
        if let Some(lines) = options.tail_lines {
            args.push("--pager-end".into());
            args.push(format!("--lines={lines}"));
        }
        args.extend(services.iter().filter(|s| !s.is_empty()).map(|s| format!("--unit={s}")));
        if !options.pattern.is_empty() {
            args.push(format!("--grep={}", options.pattern));
        }
        if let Some(boot) = options.boot {
            args.push("--boot".into());
            args.push(boot.to_string());
        }
        args
    }
}

/// `relative` under `dir`, cleaned (`.` and `..` resolved inside `dir`,
/// as Go's `http.Dir` and `SecureJoin` do), and refused if a symbolic link
/// on the way leads out of `dir`.
fn within(dir: &Path, relative: &str) -> Result<PathBuf, String> {
    let mut clean = PathBuf::new();
    for component in Path::new(&relative.replace('\\', "/")).components() {
        match component {
            Component::Normal(part) => clean.push(part),
            Component::ParentDir => {
                clean.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    let path = dir.join(&clean);
    if let (Ok(real), Ok(root)) = (std::fs::canonicalize(&path), std::fs::canonicalize(dir))
        && !real.starts_with(&root)
    {
        return Err(format!("{} leads outside {}", clean.display(), dir.display()));
    }
    Ok(path)
}

/// Serves a `/logs/...` request.
pub(crate) async fn serve(settings: &SystemLogSettings, uri: &Uri, headers: &HeaderMap) -> Response {
    if !settings.handler {
        return text(StatusCode::METHOD_NOT_ALLOWED, "logs endpoint is disabled.\n".into());
    }
    let relative = uri.path().strip_prefix("/logs").unwrap_or_default().trim_start_matches('/');
    let relative = decode(relative);
    if settings.query {
        match NodeLogQuery::parse(uri.query().unwrap_or_default()) {
            Err(errors) => return text(StatusCode::BAD_REQUEST, format!("{}\n", aggregate(&errors))),
            Ok(Some(query)) => {
                if !relative.is_empty() {
                    return text(StatusCode::NOT_ACCEPTABLE, "path not allowed in query mode\n".into());
                }
                let errors = query.validate(&settings.dir);
                if !errors.is_empty() {
                    return text(StatusCode::NOT_ACCEPTABLE, format!("{}\n", aggregate(&errors)));
                }
                if !query.services.is_empty() {
                    tracing::debug!(services = ?query.services, "node log query");
                    let gzip = headers.get(header::ACCEPT_ENCODING).is_some_and(|v| v == "gzip");
                    let body = tokio::time::timeout(QUERY_DEADLINE, answer(settings, &query))
                        .await
                        .unwrap_or_else(|_| b"\ncontext error: context deadline exceeded\n".to_vec());
                    return query_response(body, gzip);
                }
                // One file (validated): served as a path.
                return file_or_listing(settings, uri, &query.files[0]).await;
            }
            Ok(None) => {}
        }
    }
    file_or_listing(settings, uri, &relative).await
}

/// The answer's body: `text/plain`, gzipped if asked.
fn query_response(body: Vec<u8>, gzip: bool) -> Response {
    let content_type = (header::CONTENT_TYPE, "text/plain;charset=UTF-8");
    if gzip {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        if encoder.write_all(&body).is_ok()
            && let Ok(zipped) = encoder.finish()
        {
            return (StatusCode::OK, [content_type, (header::CONTENT_ENCODING, "gzip")], zipped).into_response();
        }
    }
    (StatusCode::OK, [content_type], body).into_response()
}

/// What the query's services logged: the journal's for those it knows,
/// the log files' for the others (upstream's heuristics).
async fn answer(settings: &SystemLogSettings, query: &NodeLogQuery) -> Vec<u8> {
    let known = journal_units(&settings.journalctl).await;
    let (native, files): (Vec<String>, Vec<String>) = query
        .services
        .iter()
        .cloned()
        .partition(|s| known.as_deref().is_some_and(|k| k.contains(&format!("{s}.service"))));
    let mut out = Vec::new();
    if !native.is_empty() {
        let mut command = tokio::process::Command::new(&settings.journalctl);
        command.args(query.journal_args(&native)).stdin(std::process::Stdio::null()).kill_on_drop(true);
        match command.output().await {
            Ok(output) => {
                out.extend_from_slice(&output.stdout);
                out.extend_from_slice(&output.stderr);
            }
            Err(_) if query.options.boot.unwrap_or(0) == 0 => {
                out.extend_from_slice(b"\nerror: journal output not available\n")
            }
            Err(_) => {}
        }
    }
    if files.is_empty() {
        return out;
    }
    if query.options.any() {
        out.extend_from_slice(
            format!(
                "\noptions present and query resolved to log files for [{}]\ntry without specifying options\n",
                files.join(" ")
            )
            .as_bytes(),
        );
        return out;
    }
    for service in &files {
        copy_service_file(&settings.dir, service, &mut out).await;
    }
    out
}

/// The units the journal has entries of (`journalctl --field
/// _SYSTEMD_UNIT`); `None` where there is no journal.
async fn journal_units(journalctl: &Path) -> Option<String> {
    let output = tokio::process::Command::new(journalctl)
        .args(["--field", "_SYSTEMD_UNIT"])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .ok()?;
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A service's log file: `<dir>/<s>`, `<dir>/<s>.log`, `<dir>/<s>/<s>.log`,
/// the first that is a file.
async fn copy_service_file(dir: &Path, service: &str, out: &mut Vec<u8>) {
    for name in [service.to_owned(), format!("{service}.log"), format!("{service}/{service}.log")] {
        let path = match within(dir, &name) {
            Ok(path) => path,
            Err(why) => {
                out.extend_from_slice(format!("\nerror getting log for {service}: {why}\n").as_bytes());
                return;
            }
        };
        match tokio::fs::metadata(&path).await {
            Ok(meta) if meta.is_file() => {}
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                out.extend_from_slice(format!("\nerror getting log for {service}: {e}\n").as_bytes());
                return;
            }
        }
        let read = async {
            let mut file = tokio::fs::File::open(&path).await?;
            file.read_to_end(out).await
        };
        if let Err(e) = read.await {
            out.extend_from_slice(format!("\nerror getting log for {service}: {e}\n").as_bytes());
        }
        return;
    }
    out.extend_from_slice(format!("\nlog not found for {service}\n").as_bytes());
}

/// A path under the log dir: a file's bytes, a directory's listing (a
/// directory named without its trailing `/` is redirected to it, as Go's
/// file server does).
async fn file_or_listing(settings: &SystemLogSettings, uri: &Uri, relative: &str) -> Response {
    let path = match within(&settings.dir, relative) {
        Ok(path) => path,
        Err(why) => {
            tracing::debug!(%why, "refused a /logs/ path");
            return text(StatusCode::NOT_FOUND, "404 page not found\n".into());
        }
    };
    let meta = match tokio::fs::metadata(&path).await {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return text(StatusCode::NOT_FOUND, "404 page not found\n".into());
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return text(StatusCode::FORBIDDEN, "403 Forbidden\n".into());
        }
        Err(_) => return text(StatusCode::INTERNAL_SERVER_ERROR, "500 Internal Server Error\n".into()),
    };
    if meta.is_dir() {
        if !uri.path().ends_with('/') {
            let last = uri.path().rsplit('/').next().unwrap_or_default();
            let location = format!("{last}/");
            return (StatusCode::MOVED_PERMANENTLY, [(header::LOCATION, location)]).into_response();
        }
        return listing(&path).await;
    }
    match tokio::fs::File::open(&path).await {
        Ok(file) => {
            let length = meta.len();
            let body = Body::from_stream(tokio_util::io::ReaderStream::new(file.take(length)));
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8"), (header::CONTENT_LENGTH, &length.to_string())],
                body,
            )
                .into_response()
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            text(StatusCode::FORBIDDEN, "403 Forbidden\n".into())
        }
        Err(_) => text(StatusCode::INTERNAL_SERVER_ERROR, "500 Internal Server Error\n".into()),
    }
}

/// A directory as Go's file server lists one: names sorted, directories
/// with a trailing `/`, each a link.
async fn listing(dir: &Path) -> Response {
    let mut names = Vec::new();
    match tokio::fs::read_dir(dir).await {
        Ok(mut entries) => {
            while let Ok(Some(entry)) = entries.next_entry().await {
                let mut name = entry.file_name().to_string_lossy().into_owned();
                if entry.file_type().await.is_ok_and(|t| t.is_dir()) {
                    name.push('/');
                }
                names.push(name);
            }
        }
        Err(_) => return text(StatusCode::INTERNAL_SERVER_ERROR, "Error reading directory\n".into()),
    }
    names.sort();
    let mut page = String::from("<!doctype html>\n<meta name=\"viewport\" content=\"width=device-width\">\n<pre>\n");
    for name in names {
        let href: String = name
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => (b as char).to_string(),
                other => format!("%{other:02X}"),
            })
            .collect();
        let shown = name.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&#34;");
        page.push_str(&format!("<a href=\"{href}\">{shown}</a>\n"));
    }
    page.push_str("</pre>\n");
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], page).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(dir: &Path, query: bool) -> SystemLogSettings {
        SystemLogSettings {
            handler: true,
            query,
            dir: dir.to_owned(),
            // No journal on a machine without one: the file heuristics answer.
            journalctl: dir.join("no-journalctl-here"),
        }
    }

    async fn get(settings: &SystemLogSettings, uri: &str, gzip: bool) -> (StatusCode, HeaderMap, Vec<u8>) {
        let uri: Uri = uri.parse().expect("uri");
        let mut headers = HeaderMap::new();
        if gzip {
            headers.insert(header::ACCEPT_ENCODING, "gzip".parse().expect("header"));
        }
        let response = serve(settings, &uri, &headers).await;
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.expect("body");
        (parts.status, parts.headers, bytes.to_vec())
    }

    fn log_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("kubelet.log"), "I kubelet started\nI kubelet ready\n").expect("write");
        std::fs::create_dir(dir.path().join("containerd")).expect("mkdir");
        std::fs::write(dir.path().join("containerd/containerd.log"), "containerd up\n").expect("write");
        std::fs::write(dir.path().join("a b.txt"), "spaced\n").expect("write");
        dir
    }

    #[tokio::test]
    async fn the_log_dir_is_listed_and_its_files_served() {
        let dir = log_dir();
        let s = settings(dir.path(), false);
        let (status, headers, body) = get(&s, "/logs/", false).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers[header::CONTENT_TYPE], "text/html; charset=utf-8");
        let page = String::from_utf8(body).expect("utf-8");
        assert!(page.contains("<a href=\"a%20b.txt\">a b.txt</a>\n<a href=\"containerd/\">containerd/</a>\n<a href=\"kubelet.log\">kubelet.log</a>\n"), "{page}");
        let (status, _, body) = get(&s, "/logs/kubelet.log", false).await;
        assert_eq!((status, body.as_slice()), (StatusCode::OK, b"I kubelet started\nI kubelet ready\n".as_slice()));
        let (status, _, body) = get(&s, "/logs/a%20b.txt", false).await;
        assert_eq!((status, body.as_slice()), (StatusCode::OK, b"spaced\n".as_slice()));
        let (status, headers, _) = get(&s, "/logs/containerd", false).await;
        assert_eq!(
            (status, headers[header::LOCATION].to_str().ok()),
            (StatusCode::MOVED_PERMANENTLY, Some("containerd/"))
        );
        assert_eq!(get(&s, "/logs/nothing.log", false).await.0, StatusCode::NOT_FOUND);
        // `..` stays inside the dir: it names the dir's own file.
        let (status, _, body) = get(&s, "/logs/containerd/../kubelet.log", false).await;
        assert_eq!((status, body.len()), (StatusCode::OK, 34));
        // Without the query setting, a query is not read: the listing answers.
        let (status, headers, _) = get(&s, "/logs/?query=kubelet", false).await;
        assert_eq!(
            (status, headers[header::CONTENT_TYPE].to_str().ok()),
            (StatusCode::OK, Some("text/html; charset=utf-8"))
        );
    }

    #[tokio::test]
    async fn a_link_out_of_the_log_dir_is_not_followed() {
        let dir = log_dir();
        let outside = tempfile::tempdir().expect("tempdir");
        std::fs::write(outside.path().join("secret"), "no").expect("write");
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("leak")).expect("symlink");
        let s = settings(dir.path(), true);
        assert_eq!(get(&s, "/logs/leak", false).await.0, StatusCode::NOT_FOUND);
        let (status, _, body) = get(&s, "/logs/?query=/leak", false).await;
        assert_eq!(status, StatusCode::NOT_ACCEPTABLE);
        assert!(String::from_utf8_lossy(&body).contains("leads outside"));
    }

    #[tokio::test]
    async fn the_handler_switched_off_answers_as_the_kubelets() {
        let dir = log_dir();
        let s = SystemLogSettings { handler: false, ..settings(dir.path(), true) };
        let (status, _, body) = get(&s, "/logs/kubelet.log", false).await;
        assert_eq!(
            (status, body.as_slice()),
            (StatusCode::METHOD_NOT_ALLOWED, b"logs endpoint is disabled.\n".as_slice())
        );
    }

    #[tokio::test]
    async fn a_service_without_a_journal_is_read_from_its_log_file() {
        let dir = log_dir();
        let s = settings(dir.path(), true);
        let (status, headers, body) = get(&s, "/logs/?query=kubelet", false).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers[header::CONTENT_TYPE], "text/plain;charset=UTF-8");
        assert_eq!(body, b"I kubelet started\nI kubelet ready\n");
        // `<dir>/<s>/<s>.log`, and two services one after the other.
        let (_, _, body) = get(&s, "/logs/?query=containerd&query=kubelet", false).await;
        assert_eq!(body, b"containerd up\nI kubelet started\nI kubelet ready\n");
        let (_, _, body) = get(&s, "/logs/?query=nosuch", false).await;
        assert_eq!(body, b"\nlog not found for nosuch\n");
        // Options apply to the journal only.
        let (status, _, body) = get(&s, "/logs/?query=kubelet&tailLines=1", false).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            String::from_utf8_lossy(&body),
            "\noptions present and query resolved to log files for [kubelet]\ntry without specifying options\n"
        );
        // A file by its path.
        let (status, _, body) = get(&s, "/logs/?query=/containerd/containerd.log", false).await;
        assert_eq!((status, body.as_slice()), (StatusCode::OK, b"containerd up\n".as_slice()));
        // gzip when asked.
        let (status, headers, body) = get(&s, "/logs/?query=kubelet", true).await;
        assert_eq!((status, headers[header::CONTENT_ENCODING].to_str().ok()), (StatusCode::OK, Some("gzip")));
        let mut unzipped = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(body.as_slice()), &mut unzipped).expect("gzip");
        assert_eq!(unzipped, "I kubelet started\nI kubelet ready\n");
    }

    #[tokio::test]
    async fn bad_queries_are_refused_with_upstreams_field_errors() {
        let dir = log_dir();
        let s = settings(dir.path(), true);
        let cases: &[(&str, StatusCode, &str)] = &[
            ("/logs/?query", StatusCode::BAD_REQUEST, "query: Invalid value: []string{\"\"}: query cannot be empty"),
            (
                "/logs/?query=%20%20",
                StatusCode::BAD_REQUEST,
                "query: Invalid value: []string{\"  \"}: query cannot be empty",
            ),
            (
                "/logs/?query=kubelet&sinceTime=yesterday",
                StatusCode::BAD_REQUEST,
                "sinceTime: Invalid value: \"yesterday\": invalid time format",
            ),
            (
                "/logs/?query=kubelet&tailLines=x",
                StatusCode::BAD_REQUEST,
                "tailLines: Invalid value: \"x\": strconv.Atoi: parsing \"x\": invalid syntax",
            ),
            ("/logs/?tailLines=3", StatusCode::NOT_ACCEPTABLE, "query: Required value: cannot be empty with options"),
            (
                "/logs/?query=kubelet&tailLines=100001",
                StatusCode::NOT_ACCEPTABLE,
                "tailLines: Invalid value: 100001: must be between 0 and 100000, inclusive",
            ),
            ("/logs/?query=kubelet&boot=1", StatusCode::NOT_ACCEPTABLE, "boot: Invalid value: 1: must be less than 1"),
            (
                "/logs/?query=kube%3Blet",
                StatusCode::NOT_ACCEPTABLE,
                "query: Invalid value: \"kube;let\": input contains unsupported characters",
            ),
            (
                "/logs/?query=/a&query=/b",
                StatusCode::NOT_ACCEPTABLE,
                "query: Invalid value: []string{\"/a\", \"/b\"}: cannot specify more than one file",
            ),
            ("/logs/?query=/kubelet.log&tailLines=2", StatusCode::NOT_ACCEPTABLE, "cannot specify file with options"),
            (
                "/logs/?query=/kubelet.log&query=kubelet",
                StatusCode::NOT_ACCEPTABLE,
                "cannot specify a file and service",
            ),
            (
                "/logs/?query=a&query=b&query=c&query=d&query=e",
                StatusCode::NOT_ACCEPTABLE,
                "query: Too many: 5: must have at most 4 items",
            ),
            (
                "/logs/?query=kubelet&pattern=(",
                StatusCode::NOT_ACCEPTABLE,
                "pattern: Invalid value: \"(\": error parsing regexp",
            ),
            (
                "/logs/?query=kubelet&sinceTime=2026-01-02T00:00:00Z&untilTime=2026-01-01T00:00:00Z",
                StatusCode::NOT_ACCEPTABLE,
                "must be after `sinceTime`",
            ),
            ("/logs/kubelet.log?query=kubelet", StatusCode::NOT_ACCEPTABLE, "path not allowed in query mode"),
        ];
        for (uri, code, message) in cases {
            let (status, _, body) = get(&s, uri, false).await;
            let body = String::from_utf8_lossy(&body);
            assert_eq!(status, *code, "{uri}: {body}");
            assert!(body.contains(message), "{uri}: {body}");
        }
        // Two errors at once are bracketed, as upstream's aggregate.
        let (_, _, body) = get(&s, "/logs/?query=kubelet&sinceTime=x&untilTime=y", false).await;
        assert!(
            String::from_utf8_lossy(&body).starts_with("[sinceTime: Invalid value: \"x\""),
            "{}",
            String::from_utf8_lossy(&body)
        );
    }

    #[test]
    fn the_journal_is_asked_as_upstream_asks_it() {
        let query = NodeLogQuery::parse(
            "query=kubelet&sinceTime=2026-03-04T05:06:07Z&untilTime=2026-03-04T15:16:17Z&tailLines=3&pattern=container&boot=-1",
        )
        .expect("valid")
        .expect("a query");
        assert_eq!(
            query.journal_args(&["kubelet".into()]),
            [
                "--utc",
                "--no-pager",
                "--output=short-precise",
                "--since=2026-3-4 5:6:7",
                "--until=2026-3-4 15:16:17",
                "--pager-end",
                "--lines=3",
                "--unit=kubelet",
                "--grep=container",
                "--boot",
                "-1"
            ]
        );
        assert_eq!(NodeLogQuery::parse("").expect("valid"), None);
        assert_eq!(NodeLogQuery::parse("unrelated=1").expect("valid"), None);
    }
}
