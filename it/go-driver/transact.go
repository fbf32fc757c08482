package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/apache/rocketmq-client-go/v2"
	"github.com/apache/rocketmq-client-go/v2/primitive"
)

// transact sends `count` messages in transactions with a TransactionProducer. Its local transaction answers
// `resolution` (commit, rollback, unknown); its checker answers a check-back `checkResolution` (commit). After
// the sends it stays up until `expectChecks` check-backs were answered, or `lingerMs` passed.
//
// Result: `sent` [{index, body, msgId, offsetMsgId, transactionId, status, localState, broker, queueId,
// queueOffset}], `checks` [{msgId, offsetMsgId, uniqKey, transactionId, body, topic, producerGroup, answer,
// atMs}], `errors` [{index, body, error}].
func transact(a *Args, start time.Time) (result, error) {
	local, err := transactionState(a.Resolution, "commit")
	if err != nil {
		return nil, err
	}
	checked, err := transactionState(a.CheckResolution, "commit")
	if err != nil {
		return nil, err
	}
	listener := &checker{local: local, checked: checked, changed: make(chan struct{}, 1)}
	p, err := rocketmq.NewTransactionProducer(listener, producerOptions(a)...)
	if err != nil {
		return nil, fmt.Errorf("new transaction producer: %w", err)
	}
	if err := p.Start(); err != nil {
		return nil, fmt.Errorf("start transaction producer: %w", err)
	}
	defer p.Shutdown()

	ctx, cancel := context.WithDeadline(context.Background(), a.deadline(start))
	defer cancel()
	count := a.Count
	if count == 0 {
		count = 1
	}
	sent := []result{}
	errs := []result{}
	for i := a.StartIndex; i < a.StartIndex+count; i++ {
		msg, body := message(a, i)
		// The client sends the half message, runs the local transaction, then ends the transaction (one way).
		r, err := p.SendMessageInTransaction(ctx, msg)
		if err != nil {
			errs = append(errs, result{"index": i, "body": body, "error": err.Error()})
			continue
		}
		entry := sendEntry(i, body, r.SendResult)
		entry["transactionId"] = r.TransactionID
		entry["localState"] = stateName(r.State)
		sent = append(sent, entry)
	}

	// Stay up for check-backs: until expectChecks were answered, or lingerMs, or the deadline.
	linger := time.Now().Add(time.Duration(a.LingerMs) * time.Millisecond)
	if deadline := a.deadline(start); linger.After(deadline) {
		linger = deadline
	}
	for listener.answered() < a.ExpectChecks && time.Now().Before(linger) {
		select {
		case <-listener.changed:
		case <-time.After(time.Until(linger)):
		}
	}
	if a.ExpectChecks == 0 && time.Now().Before(linger) {
		time.Sleep(time.Until(linger))
	}
	// The client ends a transaction, and answers a check-back, with a one-way request written after the listener
	// returns; Shutdown does not wait for it. A producer that exits at once takes it down unsent (a cut frame), so
	// it stays up a moment longer, as an app does.
	time.Sleep(oneWayGrace)
	return result{"sent": sent, "checks": listener.report(), "errors": errs}, nil
}

// oneWayGrace is how long a transaction producer stays up after its last end or check answer.
const oneWayGrace = time.Second

// checker is the app's transaction listener: fixed answers, and a record of every check-back.
type checker struct {
	local   primitive.LocalTransactionState
	checked primitive.LocalTransactionState
	changed chan struct{} // signalled after each check-back

	mu     sync.Mutex
	checks []result
}

// ExecuteLocalTransaction is the app's local transaction, run after the half message was stored.
func (c *checker) ExecuteLocalTransaction(*primitive.Message) primitive.LocalTransactionState {
	return c.local
}

// CheckLocalTransaction answers a check-back of a transaction the producer left undecided.
func (c *checker) CheckLocalTransaction(m *primitive.MessageExt) primitive.LocalTransactionState {
	c.mu.Lock()
	c.checks = append(c.checks, result{
		"msgId":         m.MsgId,
		"offsetMsgId":   m.OffsetMsgId,
		"uniqKey":       m.GetProperty(primitive.PropertyUniqueClientMessageIdKeyIndex),
		"transactionId": m.TransactionId,
		"body":          label(m.Body),
		"topic":         m.Topic,
		"producerGroup": m.GetProperty(primitive.PropertyProducerGroup),
		"answer":        stateName(c.checked),
		"atMs":          millis(time.Now()),
	})
	c.mu.Unlock()
	select {
	case c.changed <- struct{}{}:
	default:
	}
	return c.checked
}

func (c *checker) answered() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.checks)
}

func (c *checker) report() []result {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]result{}, c.checks...)
}

// transactionState parses an answer ("" is fallback).
func transactionState(s, fallback string) (primitive.LocalTransactionState, error) {
	if s == "" {
		s = fallback
	}
	switch s {
	case "commit":
		return primitive.CommitMessageState, nil
	case "rollback":
		return primitive.RollbackMessageState, nil
	case "unknown":
		return primitive.UnkonwnState, nil
	}
	return 0, fmt.Errorf("bad arguments: transaction answer %q", s)
}

// stateName is an answer by the Java client's name for it.
func stateName(s primitive.LocalTransactionState) string {
	switch s {
	case primitive.CommitMessageState:
		return "COMMIT_MESSAGE"
	case primitive.RollbackMessageState:
		return "ROLLBACK_MESSAGE"
	default:
		return "UNKNOW"
	}
}
