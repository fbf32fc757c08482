// Command go-driver runs one scenario with Apache's Go RocketMQ client (github.com/apache/rocketmq-client-go/v2)
// for popgate's integration tests, as it/remoting-driver does with the Java client:
//
//	go-driver <scenario> '<json args>'
//
// It prints exactly one JSON object on stdout, its last line. Exit codes: 0 the scenario ran (the JSON says what
// happened: per-message `errors`, `timedOut`); 1 it failed as a whole (`{"error": ...}`, e.g. the client did not
// start); 2 bad arguments (unknown ones included). The client's own log goes to stderr at warn
// (ROCKETMQ_GO_LOG_LEVEL=info or debug for more).
//
// Scenarios: produce, push-consume, transact (see README.md for their arguments and results).
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/apache/rocketmq-client-go/v2/primitive"
	"github.com/apache/rocketmq-client-go/v2/rlog"
)

// Args are every scenario's arguments; each scenario reads the ones it knows. A JSON field that is not one of
// these is refused (exit 2), so a test's typo does not silently run another scenario.
type Args struct {
	// Common.
	Namesrv      string `json:"namesrv"`      // the name server: popgate's remoting address, or the cluster's
	Group        string `json:"group"`        // producer or consumer group
	Topic        string `json:"topic"`        // the topic sent to or consumed
	TimeoutMs    int    `json:"timeoutMs"`    // the scenario's deadline, counted from the driver's start (30000)
	AccessKey    string `json:"accessKey"`    // with secretKey: the client signs its requests
	SecretKey    string `json:"secretKey"`    //
	InstanceName string `json:"instanceName"` // the client's instance name (two consumers of a group need two)
	RetryTimes   *int   `json:"retryTimes"`   // sends retried by the client (2)

	// produce and transact.
	Count         int               `json:"count"`         // messages (1)
	StartIndex    int               `json:"startIndex"`    // index of the first (0)
	Mode          string            `json:"mode"`          // sync (default), async, oneway, batch
	QueueID       *int              `json:"queueId"`       // a queue selector that picks this queue id ...
	BrokerName    string            `json:"brokerName"`    // ... on this broker (else on the first broker that has it)
	OrderKey      string            `json:"orderKey"`      // the client's hash selector on this sharding key
	Tag           string            `json:"tag"`           // the message's tag
	Keys          string            `json:"keys"`          // its keys, space separated
	DelayLevel    int               `json:"delayLevel"`    // its delay level
	Properties    map[string]string `json:"properties"`    // its user properties
	BodyPrefix    string            `json:"bodyPrefix"`    // body i is "<bodyPrefix>-<i>" ("m")
	BodyBytes     int               `json:"bodyBytes"`     // the body padded with 'x' to this many bytes
	SendTimeoutMs int               `json:"sendTimeoutMs"` // the client's send timeout (3000)

	// push-consume.
	Expect            int      `json:"expect"`            // distinct bodies to wait for ...
	ExpectDeliveries  int      `json:"expectDeliveries"`  // ... and deliveries in all (a retried body counts again)
	Orderly           bool     `json:"orderly"`           // an orderly consumer
	Broadcasting      bool     `json:"broadcasting"`      // BROADCASTING instead of CLUSTERING
	SubExpression     string   `json:"subExpression"`     // tag filter ("*")
	FailTimes         int      `json:"failTimes"`         // the first failTimes deliveries of ...
	FailBodies        []string `json:"failBodies"`        // ... these bodies are answered ConsumeRetryLater (orderly: suspend)
	MaxReconsumeTimes *int32   `json:"maxReconsumeTimes"` // the group's reconsumption limit
	RetryDelayLevel   int      `json:"retryDelayLevel"`   // the delay level a failed message comes back after
	ConsumeFromWhere  string   `json:"consumeFromWhere"`  // first or last (default)
	SettleMs          int      `json:"settleMs"`          // keep consuming this long after expect was reached

	// transact.
	Resolution      string `json:"resolution"`      // the local transaction's answer: commit, rollback, unknown
	CheckResolution string `json:"checkResolution"` // the checker's answer to a check-back (commit)
	ExpectChecks    int    `json:"expectChecks"`    // stay up until this many check-backs were answered ...
	LingerMs        int    `json:"lingerMs"`        // ... or this long after the sends
}

// deadline is when the scenario gives up: timeoutMs after the driver started.
func (a *Args) deadline(start time.Time) time.Time {
	timeout := a.TimeoutMs
	if timeout == 0 {
		timeout = 30000
	}
	return start.Add(time.Duration(timeout) * time.Millisecond)
}

// credentials are the client's signing keys, empty when the test gave none.
func (a *Args) credentials() primitive.Credentials {
	return primitive.Credentials{AccessKey: a.AccessKey, SecretKey: a.SecretKey}
}

// body is message i's body and the label results report it by ("<prefix>-<i>", before any padding).
func (a *Args) body(i int) ([]byte, string) {
	prefix := a.BodyPrefix
	if prefix == "" {
		prefix = "m"
	}
	label := fmt.Sprintf("%s-%d", prefix, i)
	if a.BodyBytes > len(label)+1 {
		return []byte(label + " " + strings.Repeat("x", a.BodyBytes-len(label)-1)), label
	}
	return []byte(label), label
}

// label is the label of a received body: its text up to the padding.
func label(body []byte) string {
	text := string(body)
	if i := strings.IndexByte(text, ' '); i >= 0 {
		return text[:i]
	}
	return text
}

// result is a scenario's JSON answer.
type result map[string]any

func main() {
	start := time.Now()
	if len(os.Args) != 3 {
		finish(result{"error": "usage: go-driver produce|push-consume|transact '<json args>'"}, 2)
	}
	ownedOffsetDir = keepOffsetsOutOfHome()

	scenario := os.Args[1]
	var args Args
	decoder := json.NewDecoder(bytes.NewReader([]byte(os.Args[2])))
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(&args); err != nil {
		finish(result{"scenario": scenario, "error": "bad arguments: " + err.Error()}, 2)
	}
	if args.Namesrv == "" {
		finish(result{"scenario": scenario, "error": "bad arguments: namesrv is required"}, 2)
	}
	if os.Getenv("ROCKETMQ_GO_LOG_LEVEL") == "" {
		rlog.SetLogLevel("warn")
	}

	var out result
	var err error
	switch scenario {
	case "produce":
		out, err = produce(&args, start)
	case "push-consume":
		out, err = pushConsume(&args, start)
	case "transact":
		out, err = transact(&args, start)
	default:
		finish(result{"scenario": scenario, "error": "unknown scenario"}, 2)
	}
	if out == nil {
		out = result{}
	}
	out["scenario"] = scenario
	out["client"] = "rocketmq-client-go/v2"
	out["startMs"] = millis(start)
	out["finishedMs"] = millis(time.Now())
	if err != nil {
		out["error"] = err.Error()
		finish(out, 1)
	}
	finish(out, 0)
}

// ownedOffsetDir is the temporary offset directory the driver made for itself, removed by finish.
var ownedOffsetDir string

// finish prints out as the last line of stdout and exits with code.
func finish(out result, code int) {
	if ownedOffsetDir != "" {
		os.RemoveAll(ownedOffsetDir)
	}
	text, err := json.Marshal(out)
	if err != nil {
		text = []byte(fmt.Sprintf(`{"error":%q}`, "result not encodable: "+err.Error()))
		code = 1
	}
	fmt.Println(string(text))
	os.Exit(code)
}

// offsetDirEnv is where the client keeps a broadcasting consumer's offsets; it reads the variable once, when the
// package loads, and defaults to ~/.rocketmq_client_go.
const offsetDirEnv = "rocketmq.client.localOffsetStoreDir"

// keepOffsetsOutOfHome runs the driver again (exec, same pid) with offsetDirEnv set to a fresh temporary directory
// unless it is set already, so a broadcasting consumer writes nothing under $HOME. Returns the directory to remove
// at the end ("" when the caller chose it).
func keepOffsetsOutOfHome() string {
	if dir := os.Getenv(offsetDirEnv); dir != "" {
		if strings.HasPrefix(dir, os.TempDir()) && os.Getenv("GO_DRIVER_OWNS_OFFSET_DIR") == "1" {
			return dir
		}
		return ""
	}
	dir, err := os.MkdirTemp("", "go-driver-offsets-")
	if err != nil {
		return "" // the client falls back to its default; nothing else depends on it
	}
	env := append(os.Environ(), offsetDirEnv+"="+dir, "GO_DRIVER_OWNS_OFFSET_DIR=1")
	self, err := os.Executable()
	if err == nil {
		err = syscall.Exec(self, os.Args, env)
	}
	// Only reached when the exec failed: go on with the default directory.
	os.RemoveAll(dir)
	return ""
}

// millis is t as milliseconds since the epoch (for results).
func millis(t time.Time) int64 {
	return t.UnixMilli()
}
